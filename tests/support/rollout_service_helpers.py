"""The rollout service's test harness: EnvHub with two env servers (Countdown and Broken)
registered, the rollout server beside them (``mesh``), and ``Trainer``, the trainer's side of
one Rollout stream driven by plain awaits; ``trainer_replica`` builds the trainer's LoRA
policy whose weights a test syncs. Used by test_rollout_service.py and
test_rollout_env_faults.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from identity_helpers import user_channel
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from opentinker.common.v1 import common_pb2
from opentinker.env_server import EnvServerHandle, serve
from opentinker.game import AbstractGame, StepResult
from opentinker.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from opentinker.services.envhub.server import EnvHubDeps
from opentinker.services.envhub.server import create_server as create_envhub
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.rollout.service import create_server
from opentinker.services.rollout.settings import RolloutSettings

LORA = common_pb2.LoraConfig(rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj"])


class Countdown(AbstractGame):
    """Two turns; the prompt depends on the seed; reward 0.5 per step."""

    name = "countdown"
    max_turns = 2

    def get_system_prompt(self) -> str:
        return "Count down with me."

    def reset(self, *, seed: int = 0, start: str = "") -> str:
        self.number = int(start) if start else random.Random(seed).randrange(10**6)
        self.steps = 0
        return f"Start at {self.number}."

    def step(self, action: str) -> StepResult:
        self.steps += 1
        done = self.steps >= 2
        return StepResult(
            observation=f"Now {self.number - self.steps}.",
            reward=0.5,
            done=done,
            info={"outcome": "win", "last": str(self.number - self.steps)} if done else {},
        )


class Broken(Countdown):
    """Resets fine, then raises on every step."""

    name = "broken"

    def step(self, action: str) -> StepResult:
        raise RuntimeError("out of cheese")


@dataclass
class Mesh:
    envhub_address: str
    rollout_address: str
    env: EnvServerHandle
    envhub: grpc.aio.Server


@contextlib.asynccontextmanager
async def mesh(
    env_timeout_s: float = 5.0, on_trainer_lost: Callable[[str], None] | None = None
) -> AsyncIterator[Mesh]:
    """EnvHub (no built-ins) + the Countdown env server registered with it + the rollout
    (``on_trainer_lost``: told why a stream's trainer left it unclosed)."""
    hub_settings = EnvHubSettings(port=0, builtin_envs=[], env_call_timeout_s=3.0)
    deps = EnvHubDeps.create(hub_settings)
    hub, hub_port = await create_envhub(hub_settings, deps)
    hub_address = f"127.0.0.1:{hub_port}"
    env = await asyncio.to_thread(serve, Countdown, envhub_address=hub_address, block=False)
    broken = await asyncio.to_thread(serve, Broken, envhub_address=hub_address, block=False)
    settings = RolloutSettings(
        port=0, envhub_address=hub_address, env_timeout_s=env_timeout_s, device="cpu"
    )
    rollout, port = await create_server(settings, on_trainer_lost=on_trainer_lost)
    try:
        yield Mesh(hub_address, f"127.0.0.1:{port}", env, hub)
    finally:
        await rollout.stop(0)
        await asyncio.gather(asyncio.to_thread(env.stop, 0), asyncio.to_thread(broken.stop, 0))
        await hub.stop(0)
        await deps.close()


def open_request(
    model_dir: Path, env_name: str = "countdown", **fields: object
) -> rollout_pb2.OpenRollout:
    request = rollout_pb2.OpenRollout(
        job_id="job-1",
        model=common_pb2.ModelSpec(
            base_model=str(model_dir), finetune=common_pb2.FINETUNE_MODE_LORA, lora=LORA
        ),
        env_name=env_name,
        sampling=common_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8),
        max_turns=3,
        max_episode_tokens=512,
        seed=5,
    )
    for key, value in fields.items():
        setattr(request, key, value)
    return request


class Trainer:
    """The trainer's side of one Rollout stream, driven by plain awaits."""

    def __init__(self, address: str) -> None:
        self.channel = user_channel(address)
        self.call = rollout_pb2_grpc.RolloutServiceStub(self.channel).Rollout(timeout=120)
        self.seq = 0
        self.replies: list[rollout_pb2.RolloutResponse] = []

    async def send(self, **payload: object) -> None:
        self.seq += 1
        await self.call.write(rollout_pb2.RolloutRequest(seq=self.seq, **payload))

    async def recv(self, timeout_s: float = 60.0) -> rollout_pb2.RolloutResponse:
        reply = await asyncio.wait_for(self.call.read(), timeout_s)
        assert reply is not grpc.aio.EOF, "the rollout ended the stream"
        self.replies.append(reply)
        return reply

    async def ended(self) -> bool:
        return await asyncio.wait_for(self.call.read(), 10) is grpc.aio.EOF

    async def open(self, model_dir: Path, **fields: object) -> rollout_pb2.RolloutResponse:
        await self.send(open=open_request(model_dir, **fields))
        return await self.recv()

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


def run(coro) -> None:  # noqa: ANN001 - a coroutine
    asyncio.run(asyncio.wait_for(coro, 120))


def trainer_replica(model_dir: Path) -> torch.nn.Module:
    """The trainer's policy: the same base, wrapped by peft the same way, adapters perturbed."""
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = PeftLoraConfig(
        r=4,
        lora_alpha=8.0,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(0.2 * torch.randn(p.shape, generator=generator))
    return model
