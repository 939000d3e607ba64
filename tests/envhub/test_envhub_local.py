"""EnvHub reaches its own built-in envs in-process: same servicer, same status codes and
deadlines as over gRPC, only the transport skipped."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from opentinker.env_servicer import EnvironmentServicer, spec_of
from opentinker.envhub.v1 import environment_pb2 as env_pb
from opentinker.episode_table import EpisodeTable
from opentinker.game import AbstractGame, StepResult
from opentinker.services.envhub.games.letter_env import LetterGame
from opentinker.services.envhub.local_envs import LocalEnvironmentStub
from opentinker.services.envhub.server import EnvHubDeps
from opentinker.services.envhub.settings import EnvHubSettings

pytestmark = pytest.mark.unit


class Sleepy(AbstractGame):
    def get_system_prompt(self) -> str:
        return ""

    def reset(self, **options: str) -> str:
        return "go"

    def step(self, action: str) -> StepResult:
        if action == "boom":
            raise RuntimeError("kaboom")
        time.sleep(float(action))
        return StepResult(observation="", reward=1.0, done=True)


def local_stub(factory, name: str) -> LocalEnvironmentStub:
    table = EpisodeTable(factory, env_name=name, capacity=32, idle_timeout_s=60)
    return LocalEnvironmentStub(
        EnvironmentServicer(table, spec_of(factory(), name)), max_workers=40
    )


def test_reset_and_step_answer_like_the_grpc_server() -> None:
    async def scenario() -> None:
        stub = local_stub(LetterGame, "letter")
        spec = (await stub.GetEnvironmentSpec(env_pb.GetEnvironmentSpecRequest(), timeout=1)).spec
        assert spec.name == "letter" and spec.max_turns == 1
        reset = await stub.Reset(env_pb.ResetRequest(episode_id="e", seed=3), timeout=1)
        target = reset.observation.removeprefix("Answer with the letter ").rstrip(".")
        step = await stub.Step(env_pb.StepRequest(episode_id="e", action=target), timeout=1)
        assert (step.reward, step.done) == (1.0, True)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Step(env_pb.StepRequest(episode_id="nope", action="A"), timeout=1)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND

    asyncio.run(scenario())


def test_game_errors_and_deadlines_become_status_codes() -> None:
    async def scenario() -> None:
        stub = local_stub(Sleepy, "sleepy")
        for episode in ("a", "b", "c"):
            await stub.Reset(env_pb.ResetRequest(episode_id=episode), timeout=1)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Step(env_pb.StepRequest(episode_id="a", action="boom"), timeout=1)
        assert info.value.code() == grpc.StatusCode.INTERNAL and "kaboom" in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Step(env_pb.StepRequest(episode_id="b", action="0.5"), timeout=0.1)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # A slow step runs on a thread: another episode's step is not held up by it.
        started = time.monotonic()
        slow = asyncio.ensure_future(
            stub.Step(env_pb.StepRequest(episode_id="c", action="0.5"), timeout=2)
        )
        await asyncio.sleep(0.05)
        await stub.Reset(env_pb.ResetRequest(episode_id="d"), timeout=1)
        assert time.monotonic() - started < 0.4
        assert (await slow).reward == 1.0

    asyncio.run(scenario())


def test_blocking_steps_of_many_episodes_run_side_by_side() -> None:
    """32 episodes whose step blocks 0.5 s finish together, as on the served port (asyncio's
    default pool, min(32, cores + 4) threads, would take 0.5 s per 6 episodes on 2 cores)."""

    async def scenario() -> None:
        stub = local_stub(Sleepy, "sleepy")
        ids = [f"e{i}" for i in range(32)]
        for episode in ids:
            await stub.Reset(env_pb.ResetRequest(episode_id=episode), timeout=1)
        started = time.monotonic()
        replies = await asyncio.gather(
            *(stub.Step(env_pb.StepRequest(episode_id=e, action="0.5"), timeout=5) for e in ids)
        )
        elapsed = time.monotonic() - started
        assert all(r.reward == 1.0 for r in replies)
        assert elapsed < 1.5, f"32 blocking steps took {elapsed:.2f} s: they queued"

    asyncio.run(scenario())


def test_envhub_routes_its_builtins_in_process() -> None:
    async def scenario() -> None:
        deps = EnvHubDeps.create(EnvHubSettings(port=0, builtin_envs=["letter"]))
        try:
            (instance,) = deps.registry.instances("letter")
            assert isinstance(deps.channels.stub(instance.address), LocalEnvironmentStub)
        finally:
            await deps.close()

    asyncio.run(scenario())


class WhereCalled(AbstractGame):
    """Reports the thread its reset ran on (the observation)."""

    def get_system_prompt(self) -> str:
        return ""

    def reset(self, **options: str) -> str:
        return threading.current_thread().name

    def step(self, action: str) -> StepResult:
        if action == "boom":
            raise RuntimeError("kaboom")
        return StepResult(observation="", reward=1.0, done=True)


def test_microsecond_builtins_run_on_the_event_loop_the_rest_on_pool_threads() -> None:
    async def scenario() -> None:
        table = EpisodeTable(WhereCalled, env_name="where", capacity=8, idle_timeout_s=60)
        servicer = EnvironmentServicer(table, spec_of(WhereCalled(), "where"))
        inline = LocalEnvironmentStub(servicer, max_workers=4, inline=True)
        pooled = LocalEnvironmentStub(servicer, max_workers=4)
        loop_thread = threading.current_thread().name
        on_loop = await inline.Reset(env_pb.ResetRequest(episode_id="a"), timeout=1)
        on_pool = await pooled.Reset(env_pb.ResetRequest(episode_id="b"), timeout=1)
        assert on_loop.observation == loop_thread
        assert on_pool.observation.startswith("local-env"), on_pool.observation
        # An inline call reports a game's error as the served port would.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await inline.Step(env_pb.StepRequest(episode_id="a", action="boom"), timeout=1)
        assert info.value.code() == grpc.StatusCode.INTERNAL and "kaboom" in info.value.details()
        inline.close()
        pooled.close()

    asyncio.run(scenario())


def test_envhub_calls_letter_inline_and_math_on_threads() -> None:
    async def scenario() -> None:
        deps = EnvHubDeps.create(EnvHubSettings(port=0, builtin_envs=["letter", "math"]))
        try:
            for name, inline in (("letter", True), ("math", False)):
                (instance,) = deps.registry.instances(name)
                stub = deps.channels.stub(instance.address)
                assert isinstance(stub, LocalEnvironmentStub)
                assert stub.inline is inline, name
        finally:
            await deps.close()

    asyncio.run(scenario())
