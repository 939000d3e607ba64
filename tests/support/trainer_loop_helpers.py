"""The trainer loop's test harness: a real EnvHub (built-in `letter` env) and Rollout service
plus RecordingScheduler, a small real SchedulerService that implements only
ReportJobProgress (the trainer's one call to it) and records what it is told; all gRPC servers
on 127.0.0.1:0 in this process. run_attempt() runs the real RL loop against them as the
trainer process does, run_sft() the SFT loop. Used by test_trainer_loop.py,
test_trainer_resume.py, test_staleness.py, test_sft_loop.py and test_checkpoint_storage.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from identity_service import Identities

from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker.services.common.grpc_server import aio_channel, create_aio_server
from opentinker.services.envhub.server import EnvHubDeps
from opentinker.services.envhub.server import create_server as create_envhub
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.service import create_server as create_rollout
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.reporter import SchedulerReporter
from opentinker.services.trainer.rl.loop import Outcome, RlLoop
from opentinker.services.trainer.rollout_link.rollout_client import GrpcRolloutSession
from opentinker.services.trainer.settings import TrainerSettings
from opentinker.services.trainer.sft.loop import SftLoop
from opentinker.spec import JobSpec, LoraConfig, ModelSpec, RlConfig, SamplingParams


def job_spec(model_dir: Path, **rl: object) -> JobSpec:
    rl_config = {
        "env_name": "letter",
        "env_options": {"num_letters": "4"},
        "steps": 3,
        "prompts_per_step": 2,
        "samples_per_prompt": 4,
        "learning_rate": 1e-2,
        "sampling": SamplingParams(max_new_tokens=2),
        "seed": 7,
        **rl,
    }
    return JobSpec(
        name="loop-test",
        model=ModelSpec(base_model=str(model_dir), finetune="lora", lora=LoraConfig(rank=4)),
        rl=RlConfig(**rl_config),  # type: ignore[arg-type]
    )


class RecordingScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    """ReportJobProgress only: records every report, answers stop=True from step `stop_at`."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.reports: list[scheduler_pb2.ReportJobProgressRequest] = []
        self.stop_at = stop_at

    async def ReportJobProgress(self, request, context):  # noqa: N802 - gRPC method name
        self.reports.append(request)
        stop = self.stop_at is not None and request.step.step >= self.stop_at
        return scheduler_pb2.ReportJobProgressResponse(stop=stop)

    def of(self, kind: str) -> list:
        return [getattr(r, kind) for r in self.reports if r.WhichOneof("payload") == kind]


@dataclass
class Mesh:
    rollout_address: str
    scheduler_address: str
    scheduler: RecordingScheduler
    job_token: str
    job_id: str  # the one job the rollout admits (its token's)
    engines: list[TransformersEngine] = field(default_factory=list)
    envhub_address: str = ""  # to serve more envs (opentinker.env_server.serve)


@asynccontextmanager
async def mesh(
    identities: Identities,
    engine_cls: type[TransformersEngine] = TransformersEngine,
    stop_at: int | None = None,
    job_id: str = "job-1",
) -> AsyncIterator[Mesh]:
    """Real EnvHub + real Rollout + a recording SchedulerService, all on 127.0.0.1:0."""
    envhub_settings = EnvHubSettings(port=0)
    deps = EnvHubDeps.create(envhub_settings)
    envhub, envhub_port = await create_envhub(envhub_settings, deps)
    engines: list[TransformersEngine] = []

    def factory(spec: ModelSpec) -> TransformersEngine:
        base = TransformersEngine.load(spec)
        engine = engine_cls(base.model, base.tokenizer)
        engines.append(engine)
        return engine

    # The rollout holds the job's token, as a worker would give it, and admits only that.
    job_token = identities.job_token(job_id)
    rollout_settings = RolloutSettings(
        envhub_address=f"127.0.0.1:{envhub_port}", credential=job_token
    )
    rollout, rollout_port = await create_rollout(
        rollout_settings, engine_factory=factory, job_id=job_id, attempt=1
    )
    recorder = RecordingScheduler(stop_at)
    scheduler, scheduler_port, _ = create_aio_server(
        ["opentinker.scheduler.v1.SchedulerService"], host="127.0.0.1", port=0
    )
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(recorder, scheduler)
    await scheduler.start()
    try:
        yield Mesh(
            f"127.0.0.1:{rollout_port}",
            f"127.0.0.1:{scheduler_port}",
            recorder,
            job_token,
            job_id,
            engines,
            f"127.0.0.1:{envhub_port}",
        )
    finally:
        for server in (scheduler, rollout, envhub):
            await server.stop(grace=0.5)
        await deps.close()


@dataclass
class Attempt:
    """What one run of the loop left: how it ended, the policy it trained, and the policy's
    trainable state before the first step."""

    outcome: Outcome
    policy: Policy
    initial: dict[str, torch.Tensor]


async def run_attempt(
    m: Mesh,
    spec: JobSpec,
    run_dir: Path,
    checkpoint_dir: Path | None = None,
    *,
    rollout_address: str | None = None,
    slow_open_notice_s: float = 10.0,
) -> Attempt:
    """One attempt as the trainer process runs it: seed, build the policy, run the loop."""
    assert spec.rl is not None
    torch.manual_seed(spec.rl.seed)
    policy = Policy(spec.model, learning_rate=spec.rl.learning_rate)
    initial = {n: t.clone() for n, t in policy.trainable_state().items()}
    address = rollout_address or m.rollout_address
    settings = TrainerSettings(
        collect_timeout_s=60,
        open_timeout_s=60,
        weight_sync_timeout_s=30,
        slow_open_notice_s=slow_open_notice_s,
    )
    token = m.job_token
    async with aio_channel(address, credential=token) as rc, aio_channel(m.scheduler_address) as sc:
        loop = RlLoop(
            job_id=m.job_id,
            spec=spec,
            policy=policy,
            rollout=GrpcRolloutSession(rc, address=address),
            reporter=SchedulerReporter(
                sc, address=m.scheduler_address, job_id=m.job_id, attempt=1, timeout_s=5
            ),
            run_dir=run_dir,
            settings=settings,
            checkpoint_dir=checkpoint_dir,
        )
        outcome = await loop.run()
    return Attempt(outcome, policy, initial)


async def run_loop(
    m: Mesh,
    spec: JobSpec,
    run_dir: Path,
    *,
    rollout_address: str | None = None,
    slow_open_notice_s: float = 10.0,
) -> tuple[Outcome, Policy, dict[str, torch.Tensor]]:
    """run_attempt without a checkpoint folder, as (outcome, policy, initial state)."""
    attempt = await run_attempt(
        m, spec, run_dir, rollout_address=rollout_address, slow_open_notice_s=slow_open_notice_s
    )
    return attempt.outcome, attempt.policy, attempt.initial


@asynccontextmanager
async def recording_scheduler(stop_at: int | None = None) -> AsyncIterator[RecordingScheduler]:
    recorder = RecordingScheduler(stop_at)
    server, port, _ = create_aio_server(
        ["opentinker.scheduler.v1.SchedulerService"], host="127.0.0.1", port=0
    )
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(recorder, server)
    await server.start()
    recorder.address = f"127.0.0.1:{port}"  # type: ignore[attr-defined]
    try:
        yield recorder
    finally:
        await server.stop(grace=0.5)


def run_sft(
    spec: JobSpec,
    checkpoints: Path,
    stop_at: int | None = None,
    settings: TrainerSettings | None = None,
) -> tuple[Outcome, RecordingScheduler]:
    """The SFT loop as the trainer process runs it (job sft-1), reporting to a recording
    scheduler that answers stop from step ``stop_at``."""

    async def scenario() -> tuple[Outcome, RecordingScheduler]:
        assert spec.sft is not None
        torch.manual_seed(spec.sft.seed)
        policy = Policy(spec.model, learning_rate=spec.sft.learning_rate, seed=spec.sft.seed)
        async with recording_scheduler(stop_at) as recorder:
            address = recorder.address  # type: ignore[attr-defined]
            async with aio_channel(address) as channel:
                reporter = SchedulerReporter(
                    channel, address=address, job_id="sft-1", attempt=1, timeout_s=5
                )
                loop = SftLoop(
                    job_id="sft-1",
                    spec=spec,
                    policy=policy,
                    reporter=reporter,
                    settings=settings or TrainerSettings(),
                    checkpoint_dir=checkpoints,
                )
                return await loop.run(), recorder

    return asyncio.run(scenario())
