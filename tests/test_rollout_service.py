"""RolloutService end to end over real gRPC: a real env server behind a real EnvHub, the tiny
model, and the test playing the trainer (open, weight sync with probe, batches, failures)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from identity_helpers import user_channel, user_key
from identity_service import Identities
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from opentinker.common.v1 import common_pb2
from opentinker.env_server import EnvServerHandle, serve
from opentinker.errors import UnavailableError
from opentinker.game import AbstractGame, StepResult
from opentinker.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from opentinker.services.common.launch import LaunchConfig, wait_for_file
from opentinker.services.envhub.server import EnvHubDeps
from opentinker.services.envhub.server import create_server as create_envhub
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.modeling.weights import pack_weights
from opentinker.services.rollout.envhub_client import EnvHubClient
from opentinker.services.rollout.service import create_server
from opentinker.services.rollout.settings import RolloutSettings

pytestmark = pytest.mark.integration

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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@dataclass
class Mesh:
    envhub_address: str
    rollout_address: str
    env: EnvServerHandle
    envhub: grpc.aio.Server


@contextlib.asynccontextmanager
async def mesh(env_timeout_s: float = 5.0) -> AsyncIterator[Mesh]:
    """EnvHub (no built-ins) + the Countdown env server registered with it + the rollout."""
    hub_settings = EnvHubSettings(port=0, builtin_envs=[], env_call_timeout_s=3.0)
    deps = EnvHubDeps.create(hub_settings)
    hub, hub_port = await create_envhub(hub_settings, deps)
    hub_address = f"127.0.0.1:{hub_port}"
    env = await asyncio.to_thread(serve, Countdown, envhub_address=hub_address, block=False)
    broken = await asyncio.to_thread(serve, Broken, envhub_address=hub_address, block=False)
    settings = RolloutSettings(
        port=0, envhub_address=hub_address, env_timeout_s=env_timeout_s, device="cpu"
    )
    rollout, port = await create_server(settings)
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


def test_open_sync_weights_with_probe_collect_groups_and_close(model_dir: Path) -> None:
    async def scenario() -> None:
        async with mesh() as m:
            trainer = Trainer(m.rollout_address)
            try:
                opened = (await trainer.open(model_dir)).opened
                assert (opened.engine, opened.policy_version) == ("transformers", 0)

                await trainer.send(heartbeat=common_pb2.Heartbeat(time_unix_s=time.time()))
                assert (await trainer.recv()).heartbeat.time_unix_s > 0

                # Weight sync: only the adapter travels, in several chunks; the probe proves it.
                policy = trainer_replica(model_dir)
                adapter = {n: p.detach() for n, p in policy.named_parameters() if p.requires_grad}
                probe = list(range(40, 80))
                with torch.no_grad():
                    logits = policy(input_ids=torch.tensor([probe])).logits[0, :-1]
                    expected = torch.log_softmax(logits, -1).gather(
                        -1, torch.tensor(probe[1:])[:, None]
                    )
                chunks = list(
                    pack_weights(
                        adapter,
                        policy_version=1,
                        is_adapter=True,
                        probe_token_ids=probe,
                        max_chunk_bytes=4096,
                    )
                )
                assert len(chunks) > 2
                for chunk in chunks:
                    await trainer.send(weights=chunk)
                applied = (await trainer.recv()).applied
                assert applied.policy_version == 1 and applied.apply_seconds > 0
                assert list(applied.probe_logprobs) == pytest.approx(
                    expected[:, 0].tolist(), abs=1e-4
                )

                # A batch: 2 groups x 3 samples; a group shares its prompt. A heartbeat sent
                # while it is being collected is answered first: generation is off the loop.
                await trainer.send(
                    collect=rollout_pb2.CollectTrajectories(
                        batch_index=4, num_groups=2, group_size=3
                    )
                )
                await trainer.send(heartbeat=common_pb2.Heartbeat(time_unix_s=time.time()))
                assert (await trainer.recv()).WhichOneof("payload") == "heartbeat"
                batch = (await trainer.recv()).batch
                assert batch.batch_index == 4 and len(batch.trajectories) == 6
                ids = [t.episode_id for t in batch.trajectories]
                assert ids == [f"job-1-b4-g{g}-s{i}" for g in range(2) for i in range(3)]
                prompts = {}
                for t in batch.trajectories:
                    prompt = tuple(t.token_ids[: t.prompt_length])
                    prompts.setdefault(t.group_index, set()).add(prompt)
                    assert t.policy_version == 1
                    assert len(t.logprobs) == len(t.loss_mask) == len(t.token_ids) - t.prompt_length
                    assert t.finish_reason == rollout_pb2.FINISH_REASON_ENV_DONE
                    assert (t.num_turns, t.reward, t.env_retries) == (2, 1.0, 0)
                    assert t.info["outcome"] == "win" and t.info["last"].isdigit()
                    assert "<|im_start|>user\nNow " in t.completion_text
                    assert all(
                        lp < 0 for lp, mask in zip(t.logprobs, t.loss_mask, strict=True) if mask
                    )
                    assert all(
                        lp == 0
                        for lp, mask in zip(t.logprobs, t.loss_mask, strict=True)
                        if not mask
                    )
                assert all(len(p) == 1 for p in prompts.values()), "one prompt per group"
                assert prompts[0] != prompts[1], "groups get different prompts"
                assert batch.generated_tokens == sum(sum(t.loss_mask) for t in batch.trajectories)
                assert batch.generate_seconds > 0 and batch.env_seconds > 0
                # Batch 4's episodes are closed on the env server (the closes follow the batch,
                # not awaited), and batch 5's are already reset, while the trainer trains on 4.
                deadline = time.monotonic() + 30
                while len(m.env.table) != 6 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert len(m.env.table) == 6

                await trainer.send(close=rollout_pb2.CloseRollout(reason="done"))
                assert (await trainer.recv()).closed.reason == "done"
                assert await trainer.ended()
                # The stream's end closed the episodes reset ahead: nothing is left open.
                deadline = time.monotonic() + 30
                while len(m.env.table) and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert len(m.env.table) == 0
                assert [r.seq for r in trainer.replies] == list(range(1, len(trainer.replies) + 1))
            finally:
                await trainer.close()

    run(scenario())


def test_bad_client_input_is_refused_with_a_reason(model_dir: Path) -> None:
    async def scenario() -> None:
        async with mesh() as m:

            async def failure(*steps: dict) -> rollout_pb2.RolloutFailed:
                trainer = Trainer(m.rollout_address)
                try:
                    for step in steps:
                        if step.get("open") is True:
                            assert (await trainer.open(model_dir)).WhichOneof("payload") == "opened"
                        else:
                            await trainer.send(**step)
                    reply = await trainer.recv()
                    assert reply.WhichOneof("payload") == "failed"
                    assert await trainer.ended()
                    return reply.failed
                finally:
                    await trainer.close()

            early = await failure(
                {"collect": rollout_pb2.CollectTrajectories(num_groups=1, group_size=2)}
            )
            assert early.code == "FAILED_PRECONDITION" and "OpenRollout" in early.reason

            piece = common_pb2.Tensor(
                name="w",
                shape=[4],
                dtype=common_pb2.D_TYPE_FLOAT32,
                data=b"\0" * 16,
                byte_offset=8,
                total_bytes=16,
            )
            bad_chunk = rollout_pb2.WeightChunk(policy_version=1, tensors=[piece], last=True)
            malformed = await failure({"open": True}, {"weights": bad_chunk})
            assert malformed.code == "INVALID_ARGUMENT" and "'w'" in malformed.reason

            twice = await failure({"open": True}, {"open": open_request(model_dir)})
            assert twice.code == "FAILED_PRECONDITION" and "once" in twice.reason

            unknown = next(
                pack_weights({"no.such.tensor": torch.zeros(3)}, policy_version=1, is_adapter=True)
            )
            refused = await failure({"open": True}, {"weights": unknown})
            assert refused.code == "INVALID_ARGUMENT" and "no.such.tensor" in refused.reason

            trainer = Trainer(m.rollout_address)
            try:
                reply = await trainer.open(model_dir, max_episode_tokens=-3, env_name="")
                assert reply.failed.code == "INVALID_ARGUMENT"
                assert (
                    "max_episode_tokens" in reply.failed.reason
                    and "env_name" in reply.failed.reason
                )
            finally:
                await trainer.close()

    run(scenario())


def test_unknown_or_dead_environment_fails_the_rollout_naming_it(model_dir: Path) -> None:
    async def scenario() -> None:
        async with mesh(env_timeout_s=5.0) as m:
            trainer = Trainer(m.rollout_address)
            try:
                started = time.monotonic()
                failed = (await trainer.open(model_dir, env_name="chess")).failed
                assert failed.code == "NOT_FOUND" and "'chess'" in failed.reason
                assert time.monotonic() - started < 5
            finally:
                await trainer.close()

            # Every episode fails in the environment: the batch fails, naming it and the error.
            trainer = Trainer(m.rollout_address)
            try:
                assert (await trainer.open(model_dir, env_name="broken")).HasField("opened")
                await trainer.send(
                    collect=rollout_pb2.CollectTrajectories(num_groups=2, group_size=2)
                )
                failed = (await trainer.recv()).failed
                assert failed.code == "UNAVAILABLE"
                assert "4 of 4 episodes of environment 'broken'" in failed.reason
                assert "out of cheese" in failed.reason
                assert await trainer.ended()
            finally:
                await trainer.close()

            # The env server dies without deregistering.
            trainer = Trainer(m.rollout_address)
            try:
                assert (await trainer.open(model_dir)).HasField("opened")
                await asyncio.to_thread(lambda: m.env.server.stop(0).wait())
                started = time.monotonic()
                await trainer.send(
                    collect=rollout_pb2.CollectTrajectories(num_groups=2, group_size=2)
                )
                failed = (await trainer.recv()).failed
                assert failed.code == "UNAVAILABLE" and "'countdown'" in failed.reason
                assert time.monotonic() - started < 8
                assert await trainer.ended()
            finally:
                await trainer.close()

            # EnvHub itself goes away.
            trainer = Trainer(m.rollout_address)
            try:
                await m.envhub.stop(0)
                started = time.monotonic()
                failed = (await trainer.open(model_dir)).failed
                assert failed.code == "UNAVAILABLE" and "'countdown'" in failed.reason
                assert m.envhub_address in failed.reason
                assert time.monotonic() - started < 8
            finally:
                await trainer.close()

    run(scenario())


class Sleepy(Countdown):
    name = "sleepy"

    def step(self, action: str) -> StepResult:
        time.sleep(3)
        return super().step(action)


def test_envhub_dying_mid_step_fails_the_waiting_episode_within_seconds() -> None:
    async def scenario() -> None:
        settings = EnvHubSettings(port=0, builtin_envs=[])
        deps = EnvHubDeps.create(settings)
        hub, port = await create_envhub(settings, deps)
        env = await asyncio.to_thread(
            serve, Sleepy, envhub_address=f"127.0.0.1:{port}", block=False
        )
        client = EnvHubClient(
            f"127.0.0.1:{port}", credential=user_key(), job_id="j", env_name="sleepy", timeout_s=10
        )
        try:
            spec = await client.open()
            assert spec.name == "sleepy"
            episode = client.session("e1")
            reset = await episode.reset(seed=1, options={"start": "7"})
            assert reset.observation == "Start at 7."
            step = asyncio.create_task(episode.step("6"))
            await asyncio.sleep(0.3)
            started = time.monotonic()
            await hub.stop(0)
            with pytest.raises(UnavailableError, match="'sleepy'"):
                await step
            assert time.monotonic() - started < 2
            with pytest.raises(UnavailableError):  # the stream is gone: later calls fail at once
                await client.session("e2").reset(seed=2, options={})
        finally:
            await client.close()
            await asyncio.to_thread(env.stop, 0)
            await deps.close()

    run(scenario())


def test_main_writes_its_address_serves_health_and_stops_on_sigterm(
    identities: Identities, tmp_path: Path
) -> None:
    job = common_pb2.Job(job_id="job-9")
    launch = LaunchConfig.for_job(
        job,
        lease_id="lease-1",
        device_ids=[],
        scheduler_address="127.0.0.1:1",
        envhub_address="127.0.0.1:2",
        run_dir=tmp_path,
        job_token=identities.job_token("job-9"),
    )
    launch.write(tmp_path / "launch.json")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "opentinker.services.rollout",
            "--launch",
            str(tmp_path / "launch.json"),
        ],
        env={**os.environ, "OPENTINKER_ROLLOUT_LOG_LEVEL": "WARNING"},
    )
    try:
        address = wait_for_file(
            tmp_path / "rollout.addr", timeout_s=60, alive=lambda: process.poll() is None
        )
        assert address.startswith("127.0.0.1:")
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = health.Check(
                health_pb2.HealthCheckRequest(service="opentinker.rollout.v1.RolloutService"),
                timeout=5,
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
