"""verifiers 0.4 environments in OpenTinker: played as agent programs, beside the 0.3 adapter.

verifiers 0.4 (``import verifiers.v1 as vf``) turned an env inside out: a ``vf.Env`` is a
``Taskset`` of typed tasks scored by ``@vf.reward`` methods plus a harness program that drives
the model through an OpenAI-compatible client. That is exactly the rollout's second way in,
the per-episode endpoint (``RlConfig.agent``). ``verifiers04_program`` builds the
``AgentProgram`` whose command runs one episode of the env with verifiers' own code
(``verifiers04_agent.py``: the task ``seed % len(tasks)``, its harness against the endpoint,
the reward from its rubric).

verifiers 0.3 and 0.4 are one distribution name with conflicting pins (0.4 needs mcp==2, the
``adapters`` extra's openenv does not take it), so 0.4 lives in a virtual environment of its own
(the ``verifiers04`` extra) and the command names that environment's Python; the classic
adapter (``verifiers_game``) refuses 0.4 at import with ``require_classic_verifiers``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from opentinker.errors import ConfigError
from opentinker.spec_agent import DEFAULT_AGENT_TIMEOUT_S, AgentProgram

AGENT_SCRIPT = Path(__file__).with_name("verifiers04_agent.py")
PYTHON_ENV_VAR = "OPENTINKER_VERIFIERS04_PYTHON"
CLASSIC_PIN = ">=0.3.1,<0.4"


class VerifiersVersionError(ImportError):
    """The installed verifiers is not the one this code serves; the message says what to do."""


def require_classic_verifiers(version: str) -> None:
    """Refuse verifiers >= 0.4 for the classic (0.3) adapter, naming what to use instead."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match[1]), int(match[2])) < (0, 4):
        return
    raise VerifiersVersionError(
        f"verifiers {version} is installed, but the verifiers adapter serves the classic "
        f"verifiers API (SingleTurnEnv/MultiTurnEnv/ToolEnv) of verifiers{CLASSIC_PIN}, "
        "the `adapters` extra: pip install 'opentinker[adapters]'. A verifiers 0.4 env "
        "(vf.Env: a Taskset and a harness) trains as an agent program instead: install "
        "verifiers>=0.4 (the verifiers04 extra) into a virtual environment of its own and set "
        "RlConfig.agent = verifiers04_program(python=<its python>, taskset=<taskset id>) "
        "from opentinker.services.envhub.adapters.verifiers04"
    )


def verifiers04_python() -> str:
    """The Python of the verifiers 0.4 environment: $OPENTINKER_VERIFIERS04_PYTHON."""
    python = os.environ.get(PYTHON_ENV_VAR, "")
    if not python:
        raise ConfigError(
            f"no python given and {PYTHON_ENV_VAR} is unset: pass python= the interpreter of "
            "a virtual environment with verifiers>=0.4 (the verifiers04 extra) installed"
        )
    return python


def verifiers04_program(
    *,
    taskset: str = "",
    env_config: Mapping[str, Any] | None = None,
    python: str | os.PathLike[str] = "",
    paths: Sequence[str | os.PathLike[str]] = (),
    timeout_s: float = DEFAULT_AGENT_TIMEOUT_S,
) -> AgentProgram:
    """The agent program that plays a verifiers 0.4 env, one episode per run.

    ``taskset`` is the taskset id (an installed package, e.g. ``"gsm8k"``); ``env_config`` the
    whole ``vf.EnvConfig`` as a dict when more is needed (its ``taskset.id`` then wins).
    ``python`` is the 0.4 environment's interpreter (default $OPENTINKER_VERIFIERS04_PYTHON) and
    ``paths`` folders it imports env packages from. Paths are those of the rollout's machine.
    """
    config = dict(env_config or {})
    config["taskset"] = dict(config.get("taskset") or {})
    if taskset:
        config["taskset"].setdefault("id", taskset)
    if not config["taskset"].get("id"):
        raise ConfigError(
            "verifiers04_program needs a taskset id: taskset='<id>' or "
            "env_config={'taskset': {'id': '<id>'}}"
        )
    command = [str(python or verifiers04_python()), str(AGENT_SCRIPT)]
    command += ["--env-config", json.dumps(config, sort_keys=True)]
    for path in paths:
        command += ["--path", str(path)]
    return AgentProgram(command=tuple(command), timeout_s=timeout_s)
