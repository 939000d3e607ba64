"""Env steps per second through EnvHub's RunEpisodes stream, versus calling the game directly.

A trivial game (reset, then ``--steps`` echo steps) is played
- in-process: ``game.step(...)`` in a loop, the floor any env can reach;
- through the mesh on loopback: the rollout's ``EnvHubClient`` -> EnvHub (this process, its
  own event loop) -> the SDK env server (a separate process, as in deployment), with
  ``--concurrency`` episodes at once, each stepping as fast as replies come back.
The overhead ratio is in-process steps/s divided by through-EnvHub steps/s; the per-step
latency at concurrency 1 is what one multi-turn episode pays per turn.

    .venv/bin/python bench/env_throughput.py [--steps 200] [--concurrency 1,8,32]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import textwrap
import time

from identity import BenchIdentity, bench_identity

from opentinker.game import AbstractGame, StepResult
from opentinker.services.common.logging import configure_logging
from opentinker.services.envhub.server import EnvHubDeps, create_server
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.rollout.envhub_client import EnvHubClient

ENV_SERVER = textwrap.dedent(
    """
    import sys
    from opentinker.env_server import serve
    from opentinker.game import AbstractGame, StepResult

    class Echo(AbstractGame):
        name = "echo"

        def get_system_prompt(self):
            return "Echo."

        def reset(self, *, seed=0):
            return "go"

        def step(self, action):
            return StepResult(observation=action, reward=1.0, done=False)

    serve(Echo, envhub_address=sys.argv[1], api_key=sys.argv[2], capacity=0, block=True)
    """
)


class Echo(AbstractGame):
    """The same game as the env server's, for the in-process baseline."""

    name = "echo"

    def get_system_prompt(self) -> str:
        return "Echo."

    def reset(self, *, seed: int = 0) -> str:
        return "go"

    def step(self, action: str) -> StepResult:
        return StepResult(observation=action, reward=1.0, done=False)


def inprocess_steps_per_s(episodes: int, steps: int) -> float:
    started = time.perf_counter()
    for seed in range(episodes):
        game = Echo()
        game.reset(seed=seed)
        for _ in range(steps):
            game.step("a move")
    return episodes * steps / (time.perf_counter() - started)


async def envhub_steps_per_s(
    address: str, api_key: str, concurrency: int, steps: int
) -> tuple[float, float]:
    """(steps/s over all episodes, mean seconds per step of one episode)."""
    async with EnvHubClient(
        address, credential=api_key, job_id="bench", env_name="echo", timeout_s=30
    ) as client:

        async def episode(n: int) -> None:
            session = client.session(f"bench-c{concurrency}-e{n}")
            n = max(n, 0)
            await session.reset(n, {})
            for _ in range(steps):
                await session.step("a move")
            await session.close()

        await episode(-1)  # warm up the channels
        started = time.perf_counter()
        await asyncio.gather(*(episode(n) for n in range(concurrency)))
        elapsed = time.perf_counter() - started
    return concurrency * steps / elapsed, elapsed / steps


async def main(steps: int, concurrencies: list[int]) -> None:
    configure_logging("bench", level="WARNING")
    async with bench_identity() as identity:
        await measure(identity, steps, concurrencies)


async def measure(identity: BenchIdentity, steps: int, concurrencies: list[int]) -> None:
    settings = EnvHubSettings(
        port=0,
        builtin_envs=[],
        log_level="WARNING",
        scheduler_address=identity.scheduler_address,
    )
    deps = EnvHubDeps.create(settings)
    hub, port = await create_server(settings, deps)
    address = f"127.0.0.1:{port}"
    env = subprocess.Popen(
        [sys.executable, "-c", ENV_SERVER, address, identity.api_key],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while not deps.registry.instances("echo"):
            if env.poll() is not None:
                raise SystemExit("the echo env server exited")
            await asyncio.sleep(0.05)
        baseline = inprocess_steps_per_s(200, steps)
        print(f"in-process: {baseline:,.0f} steps/s ({1e6 / baseline:.2f} us/step)")
        print(f"{'concurrency':>11} {'steps/s':>10} {'ms/step':>8} {'overhead':>10}")
        for concurrency in concurrencies:
            rate, per_step = await envhub_steps_per_s(address, identity.api_key, concurrency, steps)
            print(
                f"{concurrency:>11} {rate:>10,.0f} {per_step * 1e3:>8.2f} {baseline / rate:>9,.0f}x"
            )
    finally:
        env.terminate()
        env.wait(timeout=10)
        await hub.stop(0)
        await deps.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per episode")
    parser.add_argument("--concurrency", default="1,8,32", help="episodes at once, comma-separated")
    args = parser.parse_args()
    asyncio.run(main(args.steps, [int(c) for c in args.concurrency.split(",")]))
