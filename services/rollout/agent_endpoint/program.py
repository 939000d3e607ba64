"""Running an episode's agent program: a Python callable in this process or a command line
in a child process, given the endpoint's base URL and key, the task and a seed; its answer is
the reward, or None (the env grades)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import json
import math
import os
from collections.abc import Callable
from typing import Any

from opentinker.errors import InvalidArgumentError
from opentinker.spec_agent import AgentProgram


class AgentProgramError(Exception):
    """The program failed, ran past its time or answered something that is not a reward."""


def load_callable(program: AgentProgram) -> Callable[..., Any] | None:
    """The program's function (None for a command); an import failure names agent.callable."""
    if not program.callable:
        return None
    module_name, _, name = program.callable.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as err:
        raise InvalidArgumentError(
            f"agent.callable {program.callable!r} cannot be loaded by the rollout ({err}); "
            "install its package where the rollout runs, or give a command instead",
            code="INVALID_ARGUMENT",
        ) from err
    if not callable(function):
        raise InvalidArgumentError(
            f"agent.callable {program.callable!r} is not a function", code="INVALID_ARGUMENT"
        )
    return function


async def run_program(
    program: AgentProgram,
    function: Callable[..., Any] | None,
    threads: concurrent.futures.Executor,
    *,
    base_url: str,
    api_key: str,
    task: str,
    seed: int,
) -> float | None:
    """Play one episode; raises AgentProgramError saying what went wrong."""
    try:
        if function is not None:
            kwargs = {"base_url": base_url, "api_key": api_key, "task": task, "seed": seed}
            if inspect.iscoroutinefunction(function):
                answer = await asyncio.wait_for(function(**kwargs), program.timeout_s)
            else:
                running = asyncio.get_running_loop().run_in_executor(
                    threads, lambda: function(**kwargs)
                )
                answer = await asyncio.wait_for(running, program.timeout_s)
        else:
            answer = await _run_command(program, base_url, api_key, task, seed)
    except TimeoutError as err:
        raise AgentProgramError(
            f"the agent program ran past agent.timeout_s={program.timeout_s:g}"
        ) from err
    except AgentProgramError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's code: any failure ends the episode
        raise AgentProgramError(f"the agent program raised {type(err).__name__}: {err}") from err
    return _reward(answer)


async def _run_command(
    program: AgentProgram, base_url: str, api_key: str, task: str, seed: int
) -> Any:
    env = os.environ | {
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": api_key,
        "OPENTINKER_TASK": task,
        "OPENTINKER_SEED": str(seed),
    }
    child = await asyncio.create_subprocess_exec(
        *program.command,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(child.communicate(), program.timeout_s)
    except TimeoutError:
        child.kill()
        await child.wait()
        raise
    if child.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        raise AgentProgramError(
            f"the agent command exited with {child.returncode}: {' | '.join(tail) or 'no stderr'}"
        )
    lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        raise AgentProgramError("the agent command printed nothing; print the reward as JSON last")
    try:
        answer = json.loads(lines[-1])
    except json.JSONDecodeError as err:
        raise AgentProgramError(
            f"the last line of the agent command's stdout is not JSON: {lines[-1][:200]!r}"
        ) from err
    return answer.get("reward") if isinstance(answer, dict) else answer


def _reward(answer: Any) -> float | None:
    if answer is None:
        return None
    if isinstance(answer, bool) or not isinstance(answer, int | float) or not math.isfinite(answer):
        raise AgentProgramError(
            f"the agent program returned {answer!r}; return a finite number (the reward) or "
            "None (the environment grades the last answer)"
        )
    return float(answer)
