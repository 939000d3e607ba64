"""A rollout session over a real EnvHub for tests: a preloaded engine, two-turn episodes."""

from __future__ import annotations

import pytest

from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.rollout.config import RolloutConfig
from opentinker.services.rollout.engine import TransformersEngine
from opentinker.services.rollout.session import RolloutSession
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.services.rollout.types import TrajectoryBatch
from opentinker.spec import ModelSpec, SamplingParams


async def open_two_turn_session(
    address: str, engine: TransformersEngine, *, env_name: str, job_id: str, **settings: float
) -> RolloutSession:
    """An opened session of job ``job_id`` on ``env_name`` via EnvHub at ``address``: up to 4 new
    tokens a turn, 2 turns; ``settings`` are RolloutSettings fields (env_timeout_s 10 s)."""
    rollout_settings = RolloutSettings(
        envhub_address=address, device="cpu", **{"env_timeout_s": 10.0, **settings}
    )
    session = RolloutSession(rollout_settings, lambda spec: engine)
    await session.open(
        RolloutConfig(
            job_id=job_id,
            model=ModelSpec(base_model="preloaded", finetune="full"),
            env_name=env_name,
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4),
            max_turns=2,
            max_episode_tokens=256,
        )
    )
    return session


def assert_one_prompt_per_group(batch: TrajectoryBatch, num_groups: int) -> None:
    """Every episode of a GRPO group started from the same prompt (the group's reset seed)."""
    for g in range(num_groups):
        prompts = {
            tuple(t.token_ids[: t.prompt_length]) for t in batch.trajectories if t.group_index == g
        }
        assert len(prompts) == 1, f"group {g} has {len(prompts)} different prompts"


def tiny_engine(tmp_path_factory: pytest.TempPathFactory) -> TransformersEngine:
    """A transformers engine on a fresh random-init tiny Qwen2 (CPU)."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))
    return TransformersEngine.load(
        ModelSpec(base_model=str(model_dir), finetune="full"), device="cpu"
    )
