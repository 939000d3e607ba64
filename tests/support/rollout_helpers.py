"""Rollouts over a real EnvHub for tests: a session of a preloaded engine playing two-turn
episodes, and a shared multi-LoRA rollout server checking job tokens with the scheduler
(shared_mesh); and a rollout server with a training session's stream open (session_rollout)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from identity_helpers import user_key
from identity_service import Identities

from opentinker.rollout.v1 import rollout_pb2_grpc
from opentinker.services.common.auth import IdentityServiceAuthenticator
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.envhub.server import EnvHubDeps
from opentinker.services.envhub.server import create_server as create_envhub
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.rollout.config import RolloutConfig
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.engines.multi_lora import SharedLoraEngine
from opentinker.services.rollout.service import create_server as create_rollout
from opentinker.services.rollout.session import RolloutSession
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.services.rollout.shared.batcher import MixedBatcher
from opentinker.services.rollout.shared.shared_engine import SharedAdapters
from opentinker.services.rollout.types import TrajectoryBatch
from opentinker.services.trainer.rollout_link.rollout_client import GrpcRolloutSession
from opentinker.spec import JobSpec, ModelSpec, SamplingParams, to_proto


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


@dataclass
class SharedMesh:
    address: str
    shared: SharedAdapters


@asynccontextmanager
async def shared_mesh(
    identities: Identities,
    model_dir: Path,
    *,
    capacity: int = 2,
    window_s: float = 0.05,
    shared_cls: type[SharedAdapters] = SharedAdapters,
) -> AsyncIterator[SharedMesh]:
    """Real EnvHub + a shared rollout on 127.0.0.1:0 checking job tokens with the scheduler."""
    envhub_settings = EnvHubSettings(port=0)
    deps = EnvHubDeps.create(envhub_settings)
    envhub, envhub_port = await create_envhub(envhub_settings, deps)
    engine = SharedLoraEngine.load(str(model_dir), device="cpu")
    shared = shared_cls(MixedBatcher(engine, window_s=window_s), capacity=capacity)
    identity_channel = aio_channel(identities.scheduler_address)
    rollout, port = await create_rollout(
        RolloutSettings(envhub_address=f"127.0.0.1:{envhub_port}", device="cpu"),
        shared=shared,
        authenticator=IdentityServiceAuthenticator(
            identity_channel, address=identities.scheduler_address
        ),
    )
    try:
        yield SharedMesh(f"127.0.0.1:{port}", shared)
    finally:
        await rollout.stop(grace=0.5)
        await envhub.stop(grace=0.5)
        await identity_channel.close()
        await deps.close()


@asynccontextmanager
async def session_rollout(model_dir: Path) -> AsyncIterator[rollout_pb2_grpc.RolloutServiceStub]:
    """A private rollout server on 127.0.0.1:0 with a training session's stream open (sampling
    only) on the model at ``model_dir``: a stub for its SampleTokens and ScoreTokens."""
    key = user_key()
    server, port = await create_rollout(RolloutSettings(credential=key, device="cpu"))
    address = f"127.0.0.1:{port}"
    try:
        async with aio_channel(address, credential=key) as channel:
            rollout = GrpcRolloutSession(channel, address=address)
            spec = ModelSpec(base_model=str(model_dir), finetune="full")
            model = to_proto(JobSpec(kind="session", model=spec)).model
            await rollout.open_sampling_only(job_id="j", model=model, seed=0, timeout_s=60)
            yield rollout_pb2_grpc.RolloutServiceStub(channel)
    finally:
        await server.stop(grace=0.5)
