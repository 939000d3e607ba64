"""A batch of episodes of a microsecond built-in game through EnvHub: its calls on EnvHub's
event loop (what EnvHub does for ``INLINE_BUILTINS``) against a hop to a pool thread each.

EnvHub (in this process, with its real gRPC server and authentication) hosts the built-in
``letter`` game; the rollout's ``EnvHubClient`` plays rounds of ``--episodes`` episodes
(all reset, all step, all close, as one GRPO batch). Rounds alternate between the two ways of
calling the game (the registered stub swapped between them), and the median round of each is
printed with the ratio.

    .venv/bin/python bench/envhub_inline.py [--episodes 128] [--rounds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from identity import bench_identity  # bench/ is sys.path[0]

from opentinker.env_servicer import EnvironmentServicer, spec_of
from opentinker.services.common.logging import configure_logging
from opentinker.services.envhub.builtin_envs import BUILTIN_GAMES
from opentinker.services.envhub.local_envs import LocalEnvironmentStub
from opentinker.services.envhub.server import EnvHubDeps, create_server
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.rollout.envs.envhub_client import EnvHubClient

GAME = "letter"


async def one_round(client: EnvHubClient, name: str, episodes: int) -> float:
    started = time.monotonic()
    sessions = [client.session(f"{name}-{i}") for i in range(episodes)]
    await asyncio.gather(*(s.reset(i // 8, {"num_letters": "8"}) for i, s in enumerate(sessions)))
    await asyncio.gather(*(s.step("A") for s in sessions))
    await asyncio.gather(*(s.close() for s in sessions))
    return time.monotonic() - started


async def measure(args: argparse.Namespace) -> None:
    configure_logging("bench", level="WARNING")
    async with bench_identity() as identity:
        settings = EnvHubSettings(
            port=0,
            builtin_envs=[GAME],
            log_level="WARNING",
            scheduler_address=identity.scheduler_address,
        )
        deps = EnvHubDeps.create(settings)
        hub, port = await create_server(settings, deps)
        try:
            (instance,) = deps.registry.instances(GAME)
            inline = deps.channels.stub(instance.address)
            assert isinstance(inline, LocalEnvironmentStub) and inline.inline
            (handle,) = deps.builtins
            pooled = LocalEnvironmentStub(
                EnvironmentServicer(handle.table, spec_of(BUILTIN_GAMES[GAME](), GAME)),
                max_workers=(settings.builtin_capacity or 64) + 8,
            )
            stubs = {"on the event loop": inline, "on pool threads": pooled}
            times: dict[str, list[float]] = {way: [] for way in stubs}
            async with EnvHubClient(
                f"127.0.0.1:{port}", job_id="bench", env_name=GAME, credential=identity.api_key
            ) as client:
                for r in range(args.rounds + 2):  # two warm-up rounds
                    for way, stub in stubs.items():
                        deps.channels.add_local(instance.address, stub)
                        seconds = await one_round(client, f"r{r}-{len(times[way])}", args.episodes)
                        if r >= 2:
                            times[way].append(seconds)
            pooled.close()
        finally:
            await hub.stop(0)
            await deps.close()
    out = sys.stdout
    medians = {way: statistics.median(t) for way, t in times.items()}
    for way, median in medians.items():
        out.write(
            f"{args.episodes} reset+step+close, game {way}: median {median * 1000:.1f} ms "
            f"(min {min(times[way]) * 1000:.1f})\n"
        )
    ratio = medians["on pool threads"] / medians["on the event loop"]
    out.write(f"event loop {ratio:.2f}x faster than pool threads\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=40)
    asyncio.run(measure(parser.parse_args()))


if __name__ == "__main__":
    main()
