"""A training batch larger than one gRPC message reaches the trainer whole, in parts.

Real EnvHub, a real env server, the real rollout server with the tiny model, and the
trainer's own rollout client. A batch's trajectories carry what their episodes showed: a
vision env's images (up to 4 x 1 MiB per observation, every turn's kept) or long episodes
pass gRPC's message limit (64 MiB) at a few dozen episodes; here each episode's info carries
17 MB (the tiny text model cannot show images), so four of them pass it. One trajectory past
the limit cannot be split: the batch fails naming its episode and its size.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from identity_helpers import user_channel

from opentinker.env_server import serve
from opentinker.game import AbstractGame, StepResult
from opentinker.grpc_options import MAX_MESSAGE_BYTES
from opentinker.services.envhub.server import EnvHubDeps
from opentinker.services.envhub.server import create_server as create_envhub
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.rollout.service import create_server as create_rollout
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.services.trainer.errors import RolloutError
from opentinker.services.trainer.rollout_link.rollout_client import GrpcRolloutSession
from opentinker.spec import JobSpec, LoraConfig, ModelSpec, RlConfig, SamplingParams

pytestmark = pytest.mark.integration

EPISODES = 4
INFO_CHARS = MAX_MESSAGE_BYTES // EPISODES + (1 << 20)  # four of them pass the limit


class Verbose(AbstractGame):
    """One step; its info holds INFO_CHARS characters of the env's log."""

    name = "verbose"

    def get_system_prompt(self) -> str:
        return "Say something."

    def reset(self, *, seed: int = 0) -> str:
        return f"Episode {seed}."

    def step(self, action: str) -> StepResult:
        return StepResult("", 1.0, True, {"outcome": "win", "log": "v" * INFO_CHARS})


class Oversized(AbstractGame):
    """One step whose info takes its reply to just under the message limit (1 KiB below): the
    trajectory, with the prompt's tokens (a long system prompt, ~2 KB of them), passes it."""

    name = "oversized"

    def get_system_prompt(self) -> str:
        return "Say something. " * 120

    def reset(self, *, seed: int = 0) -> str:
        return f"Episode {seed}."

    def step(self, action: str) -> StepResult:
        return StepResult("", 1.0, True, {"log": "v" * (MAX_MESSAGE_BYTES - 1024)})


@contextlib.asynccontextmanager
async def rollout_mesh(game: type[AbstractGame] = Verbose) -> AsyncIterator[str]:
    """EnvHub with ``game`` registered, and a rollout using it; yields its address."""
    hub_settings = EnvHubSettings(port=0, builtin_envs=[])
    deps = EnvHubDeps.create(hub_settings)
    hub, hub_port = await create_envhub(hub_settings, deps)
    hub_address = f"127.0.0.1:{hub_port}"
    env = await asyncio.to_thread(serve, game, envhub_address=hub_address, block=False)
    rollout, port = await create_rollout(
        RolloutSettings(port=0, envhub_address=hub_address, env_timeout_s=30.0, device="cpu")
    )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await rollout.stop(0)
        await asyncio.to_thread(env.stop, 0)
        await hub.stop(0)
        await deps.close()


def _rl_job(game: type[AbstractGame], model: ModelSpec) -> JobSpec:
    """An RL job on ``game``'s env: groups of 2, 2 tokens a turn."""
    sampling = SamplingParams(max_new_tokens=2)
    rl = RlConfig(env_name=game.name, prompts_per_step=2, samples_per_prompt=2, sampling=sampling)
    return JobSpec(name=game.name, model=model, rl=rl)


def test_a_batch_past_the_message_limit_reaches_the_trainer_whole(tmp_path: Path) -> None:
    """The rollout sent every batch as one TrajectoryBatch message; past 64 MiB gRPC refused
    to send it ('Sent message larger than max'), the stream ended and the job failed after
    playing the whole batch, at every attempt."""
    model_dir = build_tiny_model(tmp_path / "tiny")
    model = ModelSpec(base_model=str(model_dir), finetune="lora", lora=LoraConfig(rank=4))
    spec = _rl_job(Verbose, model)

    async def scenario() -> None:
        async with rollout_mesh() as address, user_channel(address) as channel:
            session = GrpcRolloutSession(channel, address=address, weight_transport="grpc")
            await session.open(job_id="job-1", spec=spec, timeout_s=60)
            for batch_index in range(2):  # the stream goes on after a batch in parts
                batch = await session.collect(
                    batch_index=batch_index, num_groups=2, group_size=2, timeout_s=60
                )
                assert len(batch.episodes) == EPISODES
                assert [e.episode_id for e in batch.episodes] == [
                    f"job-1-b{batch_index}-g{g}-s{s}" for g in range(2) for s in range(2)
                ]
                assert all(e.outcome == "win" and not e.env_error for e in batch.episodes)
                assert batch.generated_tokens == sum(sum(e.loss_mask) for e in batch.episodes)
            await session.close(reason="done", timeout_s=10)

    asyncio.run(asyncio.wait_for(scenario(), 180))


def test_a_trajectory_past_the_message_limit_fails_the_batch_naming_it(tmp_path: Path) -> None:
    """A trajectory goes in one message; one past the limit was handed to gRPC all the same,
    which refused it ('Sent message larger than max'): the stream ended with no RolloutFailed,
    and nothing said which episode or why."""
    model_dir = build_tiny_model(tmp_path / "tiny")
    spec = _rl_job(Oversized, ModelSpec(base_model=str(model_dir), finetune="full"))

    async def scenario() -> str:
        async with rollout_mesh(Oversized) as address, user_channel(address) as channel:
            session = GrpcRolloutSession(channel, address=address, weight_transport="grpc")
            await session.open(job_id="job-1", spec=spec, timeout_s=60)
            with pytest.raises(RolloutError) as failed:
                await session.collect(batch_index=0, num_groups=1, group_size=2, timeout_s=60)
            return str(failed.value)

    message = asyncio.run(asyncio.wait_for(scenario(), 180))
    assert "rollout failed (RESOURCE_EXHAUSTED)" in message, message
    assert "episode job-1-b0-g0-s0" in message and f"({MAX_MESSAGE_BYTES} bytes" in message
    size = int(message.split("trajectory is ")[1].split(" bytes")[0])
    assert MAX_MESSAGE_BYTES < size < MAX_MESSAGE_BYTES + 4096
