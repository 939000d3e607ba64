"""Env steps per second through EnvHub's RunEpisodes stream, versus calling the game directly.

A trivial game (reset, then ``--steps`` echo steps) is played
- in-process: ``game.step(...)`` in a loop, the floor any env can reach;
- through the mesh on loopback: the rollout's ``EnvHubClient`` -> EnvHub (this process, its
  own event loop) -> the SDK env server (a separate process, as in deployment), with
  ``--concurrency`` episodes at once, each stepping as fast as replies come back.
The overhead ratio is in-process steps/s divided by through-EnvHub steps/s; the per-step
latency at concurrency 1 is what one multi-turn episode pays per turn.

The multi-turn case plays ``--episodes`` episodes of a slow env (each step sleeps
``--turn-ms`` on average: exponentially distributed, as service latencies are, capped at
10x; 2 to 6 turns an episode) with the tiny model
through the same EnvHub, with the rollout's agent loop twice in the same run: asynchronous per
episode (the default) and lockstep (all generate, then all env steps), and prints episodes/s
of both and their ratio.

    .venv/bin/python bench/env_throughput.py [--steps 200] [--concurrency 1,8,32] \
        [--episodes 32] [--turn-ms 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from contextlib import asynccontextmanager
from pathlib import Path

from identity import BenchIdentity, bench_identity

from opentinker.game import AbstractGame, StepResult
from opentinker.services.common.logging import configure_logging
from opentinker.services.envhub.server import EnvHubDeps, create_server
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.rollout.agent.agent_loop import AgentLoop
from opentinker.services.rollout.agent.env_replies import env_spec_from_proto
from opentinker.services.rollout.agent.loop_config import EpisodeRequest, LoopConfig
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.envs.envhub_client import EnvHubClient
from opentinker.services.rollout.types import Completion
from opentinker.spec import ModelSpec, SamplingParams

ENV_SERVER = textwrap.dedent(
    """
    import random
    import sys
    import time
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

    class SlowTurns(AbstractGame):
        name = "slowturns"
        turn_s = float(sys.argv[3]) / 1000

        def get_system_prompt(self):
            return "Say a word each turn."

        def reset(self, *, seed=0):
            self.rng = random.Random(seed)
            self.turns, self.played = self.rng.randint(2, 6), 0
            return "Start."

        def step(self, action):
            time.sleep(min(self.rng.expovariate(1 / self.turn_s), 10 * self.turn_s))
            self.played += 1
            return StepResult(observation="Again.", reward=1.0, done=self.played >= self.turns)

    game = {"echo": Echo, "slowturns": SlowTurns}[sys.argv[4]]
    serve(game, envhub_address=sys.argv[1], api_key=sys.argv[2], capacity=0, block=True)
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


async def agent_loop_episodes_per_s(
    address: str, api_key: str, engine: TransformersEngine, scheduling: str, episodes: int, run: int
) -> tuple[float, int]:
    """(episodes/s, engine calls) of one batch of slow multi-turn episodes through EnvHub."""
    async with EnvHubClient(
        address, credential=api_key, job_id="bench", env_name="slowturns", timeout_s=30
    ) as client:
        assert client.spec is not None, "an opened client has its env's spec"
        calls = CountingEngine(engine)
        loop = AgentLoop(
            calls,  # type: ignore[arg-type]  # the engine as is, counting its calls
            LoopConfig(
                sampling=SamplingParams(temperature=1.0, max_new_tokens=8),
                max_turns=None,
                max_episode_tokens=512,
                scheduling=scheduling,  # type: ignore[arg-type]  # checked by argparse choices
            ),
            env_spec_from_proto(client.spec),
        )
        requests = [
            EpisodeRequest(eid, n, n, client.session(eid))
            for n in range(episodes)
            for eid in [f"bench-{scheduling}-{run}-{n}"]
        ]
        started = time.perf_counter()
        await loop.run(requests, seed=run)
        elapsed = time.perf_counter() - started
    return episodes / elapsed, calls.calls


class CountingEngine:
    """The engine as is, counting its generate calls."""

    def __init__(self, engine: TransformersEngine) -> None:
        self.inner, self.calls = engine, 0
        self.name, self.tokenizer = engine.name, engine.tokenizer
        self.policy_version = engine.policy_version

    def generate(self, *args: object, **kwargs: object) -> list[Completion]:
        self.calls += 1
        return self.inner.generate(*args, **kwargs)  # type: ignore[arg-type]


async def main(args: argparse.Namespace) -> None:
    configure_logging("bench", level="WARNING")
    async with bench_identity() as identity:
        await measure(identity, args)


@asynccontextmanager
async def env_server(address: str, api_key: str, deps: EnvHubDeps, game: str, turn_ms: float):
    """The SDK env server of ``game`` in its own process, registered with EnvHub."""
    env = subprocess.Popen(
        [sys.executable, "-c", ENV_SERVER, address, api_key, str(turn_ms), game],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while not deps.registry.instances(game):
            if env.poll() is not None:
                raise SystemExit(f"the {game} env server exited")
            await asyncio.sleep(0.05)
        yield
    finally:
        env.terminate()
        env.wait(timeout=10)


async def measure(identity: BenchIdentity, args: argparse.Namespace) -> None:
    settings = EnvHubSettings(
        port=0,
        builtin_envs=[],
        log_level="WARNING",
        scheduler_address=identity.scheduler_address,
    )
    deps = EnvHubDeps.create(settings)
    hub, port = await create_server(settings, deps)
    address = f"127.0.0.1:{port}"
    try:
        async with env_server(address, identity.api_key, deps, "echo", 0):
            await measure_echo(address, identity.api_key, args.steps, args.concurrency)
        async with env_server(address, identity.api_key, deps, "slowturns", args.turn_ms):
            await measure_multi_turn(address, identity.api_key, args)
    finally:
        await hub.stop(0)
        await deps.close()


async def measure_echo(address: str, api_key: str, steps: int, concurrencies: list[int]) -> None:
    baseline = inprocess_steps_per_s(200, steps)
    print(f"in-process: {baseline:,.0f} steps/s ({1e6 / baseline:.2f} us/step)")
    print(f"{'concurrency':>11} {'steps/s':>10} {'ms/step':>8} {'overhead':>10}")
    for concurrency in concurrencies:
        rate, per_step = await envhub_steps_per_s(address, api_key, concurrency, steps)
        print(f"{concurrency:>11} {rate:>10,.0f} {per_step * 1e3:>8.2f} {baseline / rate:>9,.0f}x")


async def measure_multi_turn(address: str, api_key: str, args: argparse.Namespace) -> None:
    """Async vs lockstep agent loop, rounds interleaved so both see the same machine load."""
    model = ensure_tiny_model(Path(tempfile.gettempdir()) / "opentinker-bench-tiny-qwen2")
    engine = TransformersEngine.load(
        ModelSpec(base_model=str(model), finetune="full"), device="cpu"
    )
    rates: dict[str, list[float]] = {"async": [], "lockstep": []}
    calls: dict[str, list[int]] = {"async": [], "lockstep": []}
    await agent_loop_episodes_per_s(address, api_key, engine, "lockstep", 4, -1)  # warm up
    for run in range(args.rounds):
        for scheduling in rates:
            rate, n = await agent_loop_episodes_per_s(
                address, api_key, engine, scheduling, args.episodes, run
            )
            rates[scheduling].append(rate)
            calls[scheduling].append(n)
    print(
        f"\nmulti-turn, slow env ({args.turn_ms:g} ms/step on average, 2-6 turns): "
        f"{args.episodes} episodes a batch, {args.rounds} batches each, tiny model on CPU"
    )
    print(f"{'agent loop':>11} {'episodes/s':>11} {'engine calls':>13}")
    for scheduling, values in rates.items():
        mean_calls = statistics.fmean(calls[scheduling])
        print(f"{scheduling:>11} {statistics.fmean(values):>11.2f} {mean_calls:>13.1f}")
    ratio = statistics.fmean(rates["async"]) / statistics.fmean(rates["lockstep"])
    print(f"async / lockstep: {ratio:.2f}x episodes/s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per echo episode")
    parser.add_argument(
        "--concurrency",
        type=lambda text: [int(c) for c in text.split(",")],
        default=[1, 8, 32],
        help="echo episodes at once, comma-separated",
    )
    parser.add_argument("--episodes", type=int, default=32, help="multi-turn episodes a batch")
    parser.add_argument("--turn-ms", type=float, default=20.0, help="mean slow env step (ms)")
    parser.add_argument("--rounds", type=int, default=3, help="batches per agent loop")
    asyncio.run(main(parser.parse_args()))
