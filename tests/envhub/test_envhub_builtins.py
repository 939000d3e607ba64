"""EnvHub with its default settings hosts every built-in environment, and an episode of each
runs through the real RunEpisodes stream."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from identity_helpers import user_channel

from opentinker.envhub.v1 import envhub_pb2 as hub_pb
from opentinker.envhub.v1 import envhub_pb2_grpc
from opentinker.envhub.v1 import environment_pb2 as env_pb
from opentinker.services.envhub.builtin_envs import BUILTIN_GAMES, DEFAULT_BUILTIN_ENVS
from opentinker.services.envhub.games.math_dataset import default_math_dataset
from opentinker.services.envhub.server import EnvHubDeps, create_server
from opentinker.services.envhub.settings import EnvHubSettings

pytestmark = pytest.mark.integration


class Episodes:
    """One RunEpisodes stream; ``play`` sends a request and waits for that episode's reply."""

    def __init__(self, stub: envhub_pb2_grpc.EnvHubServiceStub) -> None:
        self.call = stub.RunEpisodes(timeout=60)
        self.seq = 0
        self.spec = env_pb.EnvironmentSpec()

    async def send(self, **payload: Any) -> hub_pb.RunEpisodesResponse:
        self.seq += 1
        await self.call.write(hub_pb.RunEpisodesRequest(seq=self.seq, **payload))
        reply = await asyncio.wait_for(self.call.read(), 10)
        assert reply is not grpc.aio.EOF
        assert not reply.HasField("failed"), reply.failed.reason
        return reply

    async def reset(self, episode_id: str, seed: int, **options: str) -> env_pb.ResetResponse:
        request = env_pb.ResetRequest(episode_id=episode_id, seed=seed, options=options)
        return (await self.send(reset=request)).reset.result

    async def step(self, episode_id: str, action: str) -> env_pb.StepResponse:
        request = env_pb.StepRequest(episode_id=episode_id, action=action)
        return (await self.send(step=request)).stepped.result


async def open_env(stub: envhub_pb2_grpc.EnvHubServiceStub, name: str) -> Episodes:
    episodes = Episodes(stub)
    spec = (await episodes.send(open=hub_pb.OpenEpisodes(job_id="j", env_name=name))).opened.spec
    assert spec.name == name
    episodes.spec = spec
    return episodes


def test_every_builtin_env_plays_an_episode_through_envhub() -> None:
    async def scenario() -> None:
        settings = EnvHubSettings(port=0)
        assert settings.builtin_envs == list(DEFAULT_BUILTIN_ENVS)
        assert set(BUILTIN_GAMES) - set(DEFAULT_BUILTIN_ENVS) == {"textworld"}  # opt-in
        deps = EnvHubDeps.create(settings)
        server, port = await create_server(settings, deps)
        try:
            async with user_channel(f"127.0.0.1:{port}") as channel:
                stub = envhub_pb2_grpc.EnvHubServiceStub(channel)
                listed = await stub.ListEnvironments(hub_pb.ListEnvironmentsRequest(), timeout=5)
                assert {i.env_name for i in listed.instances} == {
                    "letter",
                    "bandit",
                    "math",
                    "gomoku",
                    "gomoku_selfplay",
                    "code_math",
                    "geometry",
                    "geometry_tools",
                    "countdown",
                    "arithmetic",
                    "arithmetic_tools",
                }

                bandit = await open_env(stub, "bandit")
                await bandit.reset("b", seed=1, arm_probabilities="0,1")
                assert (await bandit.step("b", "B")).reward == 1.0

                math = await open_env(stub, "math")
                problem = await math.reset("m", seed=2, split="validation")
                [row] = [
                    r
                    for r in default_math_dataset().rows("validation")
                    if r.prompt == problem.observation
                ]
                graded = await math.step("m", f"So the answer is \\boxed{{{row.ground_truth}}}.")
                assert (graded.reward, graded.done, graded.info["correct"]) == (1.0, True, "true")

                gomoku = await open_env(stub, "gomoku")
                board = await gomoku.reset("g", seed=0)
                assert "A B C D E F G H I" in board.observation
                assert "Gomoku" in board.observation  # the intro comes first
                move = "A1" if "E5" in board.observation else "E5"
                moved = await gomoku.step("g", move)
                assert not moved.done and moved.info["outcome"] == "ongoing"
                assert "Your opponent played" in moved.observation

                code_math = await open_env(stub, "code_math")
                assert [tool.name for tool in code_math.spec.tools] == ["python"]
                await code_math.reset("c", seed=4, index="0")
                ran = await code_math.step("c", "```python\nprint(6 * 7)\n```")
                assert "```output\n42\n```" in ran.observation and not ran.done
        finally:
            await server.stop(0)
            await deps.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
