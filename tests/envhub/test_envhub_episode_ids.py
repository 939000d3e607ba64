"""Two RunEpisodes streams that name an episode alike (two jobs, or two tenants on a shared
env) each keep their own game: env servers key games by episode id, so EnvHub sends each
stream's ids under a prefix of its own."""

from __future__ import annotations

import asyncio

import pytest
from envhub_helpers import Episodes, envhub, run

from opentinker.game import AbstractGame, StepResult

pytestmark = pytest.mark.integration


class SeedEcho(AbstractGame):
    """Says the seed it was reset with and how many steps it took."""

    name = "seed_echo"

    def get_system_prompt(self) -> str:
        return ""

    def reset(self, *, seed: int = 0) -> str:
        self.seed, self.steps = seed, 0
        return f"seed {seed}"

    def step(self, action: str) -> StepResult:
        self.steps += 1
        return StepResult(observation=f"seed {self.seed} step {self.steps}", reward=0.0, done=False)


def test_streams_that_name_an_episode_alike_each_keep_their_own_game() -> None:
    """Before, stream B's Reset of 'ep-0' replaced stream A's game on the env server: A's next
    Step played B's game, and A's close would have ended B's."""

    async def main() -> None:
        async with envhub() as hub:
            server = await hub.serve(SeedEcho, port=0)
            try:
                a, b = Episodes(hub), Episodes(hub)
                for stream in (a, b):
                    await stream.open("seed_echo")
                await a.reset("ep-0", seed=1)
                assert (await a.recv()).reset.result.observation == "seed 1"
                await b.reset("ep-0", seed=2)
                assert (await b.recv()).reset.result.observation == "seed 2"
                await a.step("ep-0", "go")
                assert (await a.recv()).stepped.result.observation == "seed 1 step 1"
                await b.step("ep-0", "go")
                assert (await b.recv()).stepped.result.observation == "seed 2 step 1"
                await a.call.done_writing()
                await asyncio.sleep(0.3)  # A's end closes its episodes on the server
                await b.step("ep-0", "go")
                assert (await b.recv()).stepped.result.observation == "seed 2 step 2"
            finally:
                await asyncio.to_thread(server.stop, 0)

    run(main())
