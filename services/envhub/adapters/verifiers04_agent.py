"""One episode of a verifiers 0.4 environment, played as an OpenTinker agent program.

Runs with the Python of a virtual environment that has ``verifiers>=0.4`` (the ``verifiers04``
extra); it imports only the standard library and ``verifiers.v1``, never ``opentinker``, because
verifiers 0.3 (the classic adapter's) and 0.4 are one distribution name and cannot share a
virtual environment. The rollout starts it per episode (``AgentProgram.command``, built by
``verifiers04.verifiers04_program``) with its endpoint in the environment:

    OPENAI_BASE_URL, OPENAI_API_KEY  the episode's OpenAI-compatible endpoint and key
    OPENTINKER_SEED                  the episode's seed: the task is ``tasks[seed % len(tasks)]``

The env is ``vf.load_environment(EnvConfig)`` (``--env-config`` is the env's config as JSON, at
least ``{"taskset": {"id": ...}}``); the episode is verifiers' own ``Env.run_episode``: its
harness plays the task through verifiers' interception server, which relays every model call
to the endpoint; the reward is the episode's rubric (the weighted ``@reward`` sum of its trace,
the mean over traces of a multi-agent env). Last line of stdout: ``{"reward": r, ...}``. A
failed episode exits 3 with its first error on stderr, a Python without verifiers>=0.4 exits 2;
the rollout records either as an env error with that reason. Roles whose runtime the config
leaves unset run as subprocesses on the rollout's machine (verifiers' default is its cloud).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import re
import sys
from typing import Any

EXIT_WRONG_VERIFIERS = 2
EXIT_EPISODE_FAILED = 3
MODEL_NAME = "opentinker-policy"  # the endpoint serves the job's policy whatever the name


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="verifiers04_agent", description=__doc__)
    parser.add_argument("--env-config", type=json.loads, required=True, help="EnvConfig as JSON")
    parser.add_argument(
        "--path", action="append", default=[], help="a folder to import env packages from"
    )
    parser.add_argument("--seed", type=int, help="default: $OPENTINKER_SEED")
    args = parser.parse_args(argv)
    if not isinstance(args.env_config, dict) or not isinstance(
        args.env_config.get("taskset"), dict
    ):
        parser.error('--env-config must be a JSON object with "taskset": {"id": ...}')
    if args.seed is None:
        try:
            args.seed = int(os.environ["OPENTINKER_SEED"])
        except (KeyError, ValueError):
            parser.error("no --seed and no integer OPENTINKER_SEED in the environment")
    return args


def _verifiers_v1() -> Any:
    """``verifiers.v1`` of verifiers >= 0.4, or exit 2 saying which verifiers this Python has
    (0.3 ships an early ``verifiers.v1`` too, whose API 0.4 changed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("verifiers")
    except PackageNotFoundError:
        found = ""
    numbers = re.match(r"(\d+)\.(\d+)", found)
    if numbers is None or (int(numbers[1]), int(numbers[2])) < (0, 4):
        print(
            f"{sys.executable} has {'verifiers ' + found if found else 'no verifiers'}; this "
            "agent needs verifiers>=0.4: install it (the verifiers04 extra) into a virtual "
            "environment of its own (verifiers 0.3 envs: `opentinker serve verifiers-adapter`)",
            file=sys.stderr,
        )
        sys.exit(EXIT_WRONG_VERIFIERS)
    import verifiers.v1 as vf

    return vf


def pick_task(taskset: Any, seed: int) -> Any:
    """The task at ``seed % len(tasks)`` (position ``seed`` of an infinite taskset)."""
    if not taskset.bounded:
        return next(itertools.islice(iter(taskset), seed, None))
    tasks = list(taskset)
    if not tasks:
        raise ValueError(f"taskset {type(taskset).__name__} has no tasks")
    return tasks[seed % len(tasks)]


def episode_reward(episode: Any) -> float:
    """The rubric's reward of a finished episode (mean over its traces)."""
    rewards = [trace.reward for trace in episode.traces]
    if not rewards:
        raise ValueError("the episode has no trace")
    reward = sum(rewards) / len(rewards)
    if not math.isfinite(reward):
        raise ValueError(f"the rubric gave a non-finite reward ({reward})")
    return reward


def local_runtimes(vf: Any, config: Any) -> Any:
    """Each role whose runtime the config does not set runs as a subprocess here (verifiers'
    default is a remote sandbox reached through a tunnel of its cloud); set
    ``{"agent": {"runtime": {"type": "docker"}}}`` in ``--env-config`` for a container."""
    from verifiers.v1.configs.agent import agent_config_fields

    for spec in agent_config_fields(config).values():
        if "runtime" not in spec.model_fields_set:
            spec.runtime = vf.SubprocessConfig()
    return config


async def play(vf: Any, env_config: dict[str, Any], seed: int) -> dict[str, Any]:
    """Load the env, play the seed's task against $OPENAI_BASE_URL; the result line."""
    env = vf.load_environment(local_runtimes(vf, vf.resolve_env_config(env_config)))
    task = pick_task(env.taskset, seed)
    client = vf.EvalClientConfig(
        base_url=os.environ["OPENAI_BASE_URL"], api_key_var="OPENAI_API_KEY"
    )
    ctx = vf.ModelContext(model=MODEL_NAME, client=client)
    async with env.serving():
        episode = await env.run_episode(task, ctx)
    if not episode.ok:
        errors = [*episode.errors, *(e for t in episode.traces if (e := t.last_error))]
        reason = f"{errors[0].type}: {errors[0].message}" if errors else "not ok, no error recorded"
        raise RuntimeError(f"verifiers episode failed: {reason}")
    return {
        "reward": episode_reward(episode),
        "task_idx": task.data.idx,
        "rewards": {
            name: r.score for t in episode.traces for name, r in t.rewards.items() if r is not None
        },
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    sys.path[:0] = args.path
    vf = _verifiers_v1()
    try:
        result = asyncio.run(play(vf, args.env_config, args.seed))
    except Exception as err:  # noqa: BLE001 - any failure ends the episode, named on stderr
        print(f"{type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_EPISODE_FAILED
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
