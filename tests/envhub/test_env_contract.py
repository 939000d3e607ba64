"""The environment contract honoured: the env's own turn limit and tools reach the rollout.

A real env server behind a real EnvHub, the tiny model, a rollout session opened as a job
with no max_turns of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from opentinker.env_server import serve
from opentinker.game import AbstractGame, StepResult
from opentinker.services.envhub.server import EnvHubDeps
from opentinker.services.envhub.server import create_server as create_envhub
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.rollout.config import RolloutConfig
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.session import RolloutSession
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.services.rollout.types import FinishReason
from opentinker.spec import ModelSpec, SamplingParams

pytestmark = pytest.mark.integration


class FourTurns(AbstractGame):
    """Declares max_turns = 4 and ends itself on the fourth step."""

    name = "four-turns"
    max_turns = 4

    def get_system_prompt(self) -> str:
        return "Answer each turn."

    def reset(self, *, seed: int = 0) -> str:
        self.steps = 0
        return f"Say four things ({seed})."

    def step(self, action: str) -> StepResult:
        self.steps += 1
        return StepResult(observation="Go on.", reward=0.25, done=self.steps >= 4)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> TransformersEngine:
    model_dir: Path = build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))
    return TransformersEngine.load(
        ModelSpec(base_model=str(model_dir), finetune="full"), device="cpu"
    )


@contextlib.asynccontextmanager
async def hub_with(game: type[AbstractGame]) -> AsyncIterator[str]:
    """EnvHub (no built-ins) with ``game``'s server registered; yields EnvHub's address."""
    settings = EnvHubSettings(port=0, builtin_envs=[], env_call_timeout_s=5.0)
    deps = EnvHubDeps.create(settings)
    hub, port = await create_envhub(settings, deps)
    address = f"127.0.0.1:{port}"
    env = await asyncio.to_thread(serve, game, envhub_address=address, block=False)
    try:
        yield address
    finally:
        await asyncio.to_thread(env.stop, 0)
        await hub.stop(0)
        await deps.close()


async def open_session(
    address: str, engine: TransformersEngine, env_name: str, **config: object
) -> RolloutSession:
    session = RolloutSession(
        RolloutSettings(envhub_address=address, device="cpu", env_timeout_s=10.0),
        lambda spec: engine,
    )
    await session.open(
        RolloutConfig(
            job_id="job-contract",
            model=ModelSpec(base_model="preloaded", finetune="full"),
            env_name=env_name,
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4),
            max_episode_tokens=512,
            **config,
        )
    )
    return session


def test_a_job_without_max_turns_plays_the_envs_own_turns(engine: TransformersEngine) -> None:
    async def scenario() -> None:
        async with hub_with(FourTurns) as address:
            session = await open_session(address, engine, "four-turns")
            batch = await session.collect(0, num_groups=1, group_size=2)
            for t in batch.trajectories:
                assert t.num_turns == 4, (t.num_turns, t.finish_detail)
                assert t.finish_reason is FinishReason.ENV_DONE
                assert t.reward == pytest.approx(1.0)  # 4 steps * 0.25
            capped = await open_session(address, engine, "four-turns", max_turns=2)
            batch = await capped.collect(0, num_groups=1, group_size=2)
            assert [t.num_turns for t in batch.trajectories] == [2, 2]  # the job's cap wins
            assert {t.finish_reason for t in batch.trajectories} == {FinishReason.MAX_TURNS}

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_turn_limit_is_the_jobs_cap_else_the_envs_else_the_default() -> None:
    from opentinker.services.rollout.agent.loop_config import DEFAULT_MAX_TURNS, turn_limit

    assert turn_limit(3, 4) == 3
    assert turn_limit(None, 4) == 4
    assert turn_limit(None, 0) == DEFAULT_MAX_TURNS


def test_job_specs_leave_max_turns_unset_by_default_on_the_wire() -> None:
    from opentinker.common.v1 import common_pb2
    from opentinker.spec_inference import InferenceConfig, inference_to_proto
    from opentinker.spec_rl import RlConfig, rl_to_proto

    rl = RlConfig(env_name="four-turns")
    assert rl.max_turns is None and rl_to_proto(rl).max_turns == 0  # 0 = the env's own limit
    assert inference_to_proto(InferenceConfig(env_name="x")).max_turns == 0
    assert rl_to_proto(RlConfig(env_name="x", max_turns=3)).max_turns == 3
    assert isinstance(rl_to_proto(rl), common_pb2.RlConfig)
