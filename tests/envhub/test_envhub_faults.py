"""EnvHub when something goes wrong: capacity waits, slow and failing games, deadlines,
oversized observations and non-finite rewards. Each fails the episode it concerns, naming why,
and no other. Env servers that go away or stop answering: test_envhub_lost_servers.py."""

from __future__ import annotations

import asyncio
import math
import time

import grpc
import pytest
from envhub_helpers import Episodes, SlowGame, envhub, run

from opentinker.env_auth import new_env_token
from opentinker.envhub.v1 import envhub_pb2 as hub_pb
from opentinker.envhub.v1 import environment_pb2 as env_pb
from opentinker.envhub.v1 import environment_pb2_grpc
from opentinker.game import AbstractGame, StepResult
from opentinker.services.envhub.games.letter_env import LetterGame
from opentinker.services.envhub.settings import EnvHubSettings


def test_envhub_gives_up_on_a_slot_before_the_rollout_gives_up_on_envhub() -> None:
    from opentinker.services.rollout.settings import RolloutSettings

    rollout_deadline = RolloutSettings.model_fields["env_timeout_s"].default
    assert EnvHubSettings.model_fields["capacity_wait_s"].default < rollout_deadline


@pytest.mark.integration
def test_a_reset_at_capacity_waits_for_a_slot_then_fails_after_the_wait() -> None:
    """Jobs sharing an env queue for it: a Reset while every slot is held waits until another
    stream's episode closes; with nothing released it fails RESOURCE_EXHAUSTED after
    capacity_wait_s, naming the capacity."""

    async def scenario() -> None:
        async with envhub(capacity_wait_s=1.0) as hub:
            handle = await hub.serve(LetterGame, name="letters", capacity=2)
            try:
                first, second = Episodes(hub), Episodes(hub)
                await first.open("letters")
                await second.open("letters")
                for episode_id in ("a1", "a2"):
                    await first.reset(episode_id)
                    assert (await first.recv()).reset.episode_id == episode_id
                await second.reset("b1")  # both slots held: waits
                reply = asyncio.ensure_future(second.recv(timeout_s=5))
                await asyncio.sleep(0.3)
                assert not reply.done()  # (cancelling a read would end the whole call)
                await first.send(close_episode=env_pb.CloseEpisodeRequest(episode_id="a1"))
                assert (await reply).reset.episode_id == "b1"
                started = time.monotonic()
                await second.reset("b2")  # full again, and nothing closes now
                failed = (await second.recv(timeout_s=3)).failed
                assert (failed.episode_id, failed.code) == ("b2", "RESOURCE_EXHAUSTED")
                assert "at capacity" in failed.reason
                assert 0.9 <= time.monotonic() - started < 2.5
            finally:
                await asyncio.to_thread(handle.stop, 0)

    run(scenario())


@pytest.mark.integration
def test_a_slow_episode_does_not_block_others_and_game_errors_fail_one_episode() -> None:
    async def scenario() -> None:
        async with envhub() as hub:
            handle = await hub.serve(SlowGame)
            try:
                episodes = Episodes(hub)
                await episodes.open("slow")
                for episode_id in ("slow", "fast", "bad"):
                    await episodes.reset(episode_id)
                    assert (await episodes.recv()).reset.episode_id == episode_id
                started = time.monotonic()
                await episodes.step("slow", "1.0")
                await episodes.step("fast", "0.0")
                first = await episodes.recv()
                assert first.stepped.episode_id == "fast"
                assert time.monotonic() - started < 0.6
                await episodes.step("bad", "boom")
                failed = (await episodes.recv()).failed
                assert (failed.episode_id, failed.code) == ("bad", "INTERNAL")
                assert "'slow'" in failed.reason and handle.address in failed.reason
                assert "RuntimeError: out of cheese" in failed.reason
                assert (await episodes.recv(timeout_s=3)).stepped.episode_id == "slow"
            finally:
                await asyncio.to_thread(handle.stop, 0)

    run(scenario())


@pytest.mark.integration
def test_env_call_deadline_gives_episode_failed() -> None:
    async def scenario() -> None:
        async with envhub(env_call_timeout_s=0.5) as hub:
            handle = await hub.serve(SlowGame)
            try:
                episodes = Episodes(hub)
                await episodes.open("slow")
                await episodes.reset("e")
                await episodes.recv()
                await episodes.step("e", "3.0")
                failed = (await episodes.recv(timeout_s=2.5)).failed
                assert failed.code == "DEADLINE_EXCEEDED"
                assert "'slow'" in failed.reason and "within 0.5 s" in failed.reason
            finally:
                await asyncio.to_thread(handle.stop, 0)

    run(scenario())


class Talker(AbstractGame):
    """Replies with an observation of as many characters as the action (or reset option) says."""

    name = "talker"

    def get_system_prompt(self) -> str:
        return ""

    def reset(self, *, seed: int = 0, length: str = "2") -> str:
        return "r" * int(length)

    def step(self, action: str) -> StepResult:
        return StepResult(observation="s" * int(action), reward=0.0, done=False)


@pytest.mark.integration
def test_an_observation_over_envhubs_limit_fails_the_episode_naming_env_and_size() -> None:
    async def scenario() -> None:
        async with envhub(max_observation_chars=50) as hub:
            # The SDK server's own limit is off, so only EnvHub's check stands in the way.
            handle = await hub.serve(Talker, max_observation_chars=0)
            try:
                episodes = Episodes(hub)
                await episodes.open("talker")
                await episodes.reset("e")
                await episodes.recv()
                await episodes.step("e", "50")
                assert len((await episodes.recv()).stepped.result.observation) == 50
                await episodes.step("e", "51")
                failed = (await episodes.recv()).failed
                assert (failed.episode_id, failed.code) == ("e", "INTERNAL")
                assert "'talker'" in failed.reason and handle.address in failed.reason
                assert "observation of 51 characters" in failed.reason
                assert "max_observation_chars (50)" in failed.reason
                await episodes.reset("big", length="60")
                failed = (await episodes.recv()).failed
                assert "Reset replied with an observation of 60 characters" in failed.reason
                for _ in range(40):  # both episodes were closed on the env server
                    if len(handle.table) == 0:
                        break
                    await asyncio.sleep(0.05)
                assert len(handle.table) == 0
                assert [i.active_episodes for i in await hub.instances("talker")] == [0]
            finally:
                await asyncio.to_thread(handle.stop, 0)

    run(scenario())


class NanEnvironment(environment_pb2_grpc.EnvironmentServiceServicer):
    """An env server written without the SDK (as another language would) that replies NaN."""

    async def GetEnvironmentSpec(self, request, context):  # noqa: N802
        return env_pb.GetEnvironmentSpecResponse(spec=env_pb.EnvironmentSpec(name="nan"))

    async def Reset(self, request, context):  # noqa: N802
        return env_pb.ResetResponse(observation="go")

    async def Step(self, request, context):  # noqa: N802
        return env_pb.StepResponse(reward=math.nan, done=True)

    async def CloseEpisode(self, request, context):  # noqa: N802
        return env_pb.CloseEpisodeResponse()


@pytest.mark.integration
def test_a_non_finite_reward_from_any_env_server_fails_the_episode() -> None:
    async def scenario() -> None:
        server = grpc.aio.server()
        environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(NanEnvironment(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with envhub() as hub:
                await hub.stub.RegisterEnvironment(
                    hub_pb.RegisterEnvironmentRequest(
                        env_name="nan",
                        address=f"127.0.0.1:{port}",
                        capacity=0,
                        env_token=new_env_token(),
                    ),
                    timeout=5,
                )
                episodes = Episodes(hub)
                await episodes.open("nan")
                await episodes.reset("e")
                await episodes.recv()
                await episodes.step("e", "x")
                failed = (await episodes.recv()).failed
                assert failed.code == "INTERNAL" and "non-finite reward" in failed.reason
                assert "'nan'" in failed.reason
        finally:
            await server.stop(0)

    run(scenario())


def test_the_env_adapters_give_up_before_the_rollout_gives_up_on_envhub() -> None:
    from opentinker.services.envhub.adapters.serve_args import ADAPTER_TIMEOUT_S
    from opentinker.services.rollout.settings import RolloutSettings

    assert RolloutSettings.model_fields["env_timeout_s"].default > ADAPTER_TIMEOUT_S
