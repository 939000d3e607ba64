"""The trainer process: serve TrainerService, connect to rollout and scheduler, run the job."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import structlog
import torch
import transformers

from opentinker.common.v1 import common_pb2
from opentinker.errors import ConfigError
from opentinker.grpc_options import host_port
from opentinker.services.common.auth import (
    JOBS,
    USERS,
    WORKERS,
    Authenticator,
    AuthInterceptor,
    OwnCredentialAuthenticator,
    rules_for,
)
from opentinker.services.common.grpc_server import aio_channel, create_aio_server, mark_serving
from opentinker.services.common.heap import freeze_loaded_heap
from opentinker.services.common.launch import LaunchConfig, write_atomic
from opentinker.services.modeling.placement import placement_here
from opentinker.services.modeling.preload import Preload
from opentinker.services.trainer.errors import RolloutError
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.parallel.distributed import Rank
from opentinker.services.trainer.parallel.rank_job import (
    lead,
    rank_device,
    release,
    run_follower,
    world_from_env,
)
from opentinker.services.trainer.parallel.ranks import LeaderPolicy, check_data_parallel
from opentinker.services.trainer.reporter import SchedulerReporter, report_failure_logged
from opentinker.services.trainer.rl.inference_job import InferenceJob
from opentinker.services.trainer.rl.loop import Outcome, RlLoop, TrainerStatus
from opentinker.services.trainer.rollout_link.rollout_address import RolloutAddress
from opentinker.services.trainer.rollout_link.rollout_client import GrpcRolloutSession
from opentinker.services.trainer.session.run import run_session
from opentinker.services.trainer.session.servicer import SessionServicer
from opentinker.services.trainer.session.training_session import TrainingSession
from opentinker.services.trainer.settings import TrainerSettings
from opentinker.services.trainer.sft.loop import SftLoop
from opentinker.spec import JobSpec, from_proto
from opentinker.trainer.v1 import trainer_pb2, trainer_pb2_grpc

log = structlog.get_logger()

SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name
_FINETUNE_PB = {"lora": common_pb2.FINETUNE_MODE_LORA, "full": common_pb2.FINETUNE_MODE_FULL}


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    """Answers from the loop's TrainerStatus; nothing else."""

    def __init__(self, status: TrainerStatus) -> None:
        self._status = status

    async def GetTrainerStatus(
        self, request: trainer_pb2.GetTrainerStatusRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.GetTrainerStatusResponse:
        s = self._status
        return trainer_pb2.GetTrainerStatusResponse(
            job_id=s.job_id,
            step=s.step,
            policy_version=s.policy_version,
            finetune=_FINETUNE_PB.get(s.finetune, common_pb2.FINETUNE_MODE_UNSPECIFIED),
            trainable_parameters=s.trainable_parameters,
            last_metrics=s.last_metrics,
        )


# Every call: the job's own token, or a user key. A user reaches an RL job's trainer only if
# it holds the job token; a session's trainer admits users of its tenant (SessionServicer).
_SESSION_CALLS = (
    "Forward",
    "ForwardBackward",
    "OptimStep",
    "Sample",
    "SaveWeightsForSampler",
    "SaveState",
    "LoadState",
    "GetSessionInfo",
    "CloseSession",
)
ACCESS_RULES = rules_for(
    trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"],
    {
        "GetTrainerStatus": JOBS | USERS,
        **dict.fromkeys(_SESSION_CALLS, JOBS | USERS),
        # A shared LoRA host's worker hands it sessions (session/host_server.py)
        "OpenHostedSession": WORKERS,
    },
)


async def create_server(
    settings: TrainerSettings, status: TrainerStatus, *, authenticator: Authenticator
) -> tuple[grpc.aio.Server, int]:
    """A started TrainerService server (health + reflection) on settings.host:settings.port,
    admitting only the callers ``authenticator`` knows (the job's own token)."""
    return await _serve(settings, TrainerServicer(status), authenticator)


async def create_session_server(
    settings: TrainerSettings, session: TrainingSession, authenticator: Authenticator
) -> tuple[grpc.aio.Server, int]:
    """A started TrainerService server answering a session job's calls."""
    return await _serve(settings, SessionServicer(session), authenticator)


async def _serve(
    settings: TrainerSettings,
    servicer: trainer_pb2_grpc.TrainerServiceServicer,
    authenticator: Authenticator,
) -> tuple[grpc.aio.Server, int]:
    server, port, health = create_aio_server(
        [SERVICE_NAME],
        host=settings.host,
        port=settings.port,
        interceptors=[AuthInterceptor(authenticator, ACCESS_RULES)],
    )
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, server)
    await server.start()
    await mark_serving(health, [SERVICE_NAME])
    return server, port


async def run_job(
    launch: LaunchConfig,
    rollout: RolloutAddress | None,
    settings: TrainerSettings,
    preload: Preload | None = None,
) -> int:
    """Run the launched job to its end; the process exit code (0 success/cancel, 1 failure,
    exit_codes.RETRY_LATER: a storage fault with on_storage_error=requeue).
    ``rollout``: the job's rollout (None for SFT, which has none); its address is waited for
    only where the rollout is opened, so the policy loads while the rollout starts.
    ``preload``: the base model a warm spare read before the job came (used if it matches)."""
    job = launch.job
    job_log = log.bind(job_id=job.job_id, attempt=job.attempt)
    token = launch.job_token
    me = world_from_env()  # one rank of several: rank 0 runs the job, the others follow it
    if me is not None and not me.is_leader:
        return await run_follower(launch, settings, me)
    async with aio_channel(launch.scheduler_address, credential=token) as scheduler_channel:
        reporter = SchedulerReporter(
            scheduler_channel,
            address=launch.scheduler_address,
            job_id=job.job_id,
            attempt=job.attempt,
            timeout_s=settings.report_timeout_s,
            retry_for_s=settings.report_retry_s,
        )
        try:
            spec, settings = _spec_and_placement(launch, settings, me, job_log)
        except ConfigError as err:
            return await _report_failure(reporter, str(err), job_log)
        if spec.kind != "sft" and rollout is None:
            reason = (
                f"a {spec.kind} job's trainer needs --rollout-address or --rollout-address-file "
                "(the job's rollout)"
            )
            return await _report_failure(reporter, reason, job_log)
        if spec.kind == "session":
            assert rollout is not None
            return await run_session(
                launch, spec, rollout, settings, reporter, create_session_server, preload
            )
        status = TrainerStatus(job_id=job.job_id, finetune=spec.model.finetune)
        authenticator = OwnCredentialAuthenticator(token, job_id=job.job_id, attempt=job.attempt)
        server, port = await create_server(settings, status, authenticator=authenticator)
        try:
            write_atomic(Path(launch.run_dir) / "trainer.addr", host_port(settings.host, port))
            job_log.info("trainer_serving", port=port, rollout=str(rollout), kind=spec.kind)
            if spec.kind == "inference":
                assert rollout is not None
                return await _infer(job.job_id, spec, launch, rollout, settings, reporter)
            return await _train(
                job.job_id, spec, launch, rollout, settings, reporter, status, preload
            )
        finally:
            await server.stop(grace=1.0)


def _spec_and_placement(
    launch: LaunchConfig,
    settings: TrainerSettings,
    me: Rank | None,
    job_log: structlog.stdlib.BoundLogger,
) -> tuple[JobSpec, TrainerSettings]:
    """The job's spec and the settings on its leased device; ConfigError names what is wrong
    (a bad spec, a lease this process cannot use, a spec several ranks cannot shard)."""
    spec = from_proto(launch.job.spec)
    # The rollout reads the same lease by the same rule: both agree (placement.py).
    placement = placement_here(launch.device_ids, override=settings.device)
    settings = settings.model_copy(update={"device": rank_device(placement.device)})
    job_log.info("placement", device=settings.device, dtype=str(placement.dtype))
    if me is not None:
        check_data_parallel(spec, me.world_size)
    elif placement.num_devices > 1:  # the worker starts ranks for RL jobs only
        job_log.warning("one_rank_of_many", leased_devices=placement.num_devices)
    return spec, settings


async def _train(
    job_id: str,
    spec: JobSpec,
    launch: LaunchConfig,
    rollout: RolloutAddress | None,
    settings: TrainerSettings,
    reporter: SchedulerReporter,
    status: TrainerStatus,
    preload: Preload | None,
) -> int:
    job = spec.rl or spec.sft  # what both kinds share: learning_rate, seed
    assert job is not None
    torch.manual_seed(job.seed)
    transformers.utils.logging.disable_progress_bar()  # keep trainer.log to structured lines
    preloaded = preload.take(spec.model.base_model) if preload is not None else None
    log.info("policy_loading", job_id=job_id, kind=spec.kind, preloaded=preloaded is not None)
    try:
        policy = await asyncio.to_thread(
            Policy,
            spec.model,
            learning_rate=job.learning_rate,
            device=settings.device,
            preloaded=preloaded,
            seed=job.seed,
        )
    except (OSError, ValueError) as err:
        reason = f"could not load model {spec.model.base_model!r}: {type(err).__name__}: {err}"
        return await _report_failure(reporter, reason, log.bind(job_id=job_id))
    freeze_loaded_heap("policy")
    if spec.kind == "sft":
        outcome = await SftLoop(
            job_id=job_id,
            spec=spec,
            policy=policy,
            reporter=reporter,
            settings=settings,
            status=status,
            checkpoint_dir=launch.checkpoint_dir or Path(launch.run_dir) / "checkpoints",
        ).run()
        return outcome.exit_code  # RETRY_LATER: re-queued (on_storage_error)
    assert rollout is not None  # run_job checked it
    if world_from_env() is None:
        return await _run_rl(job_id, spec, launch, rollout, settings, reporter, status, policy)
    try:  # rank 0 of several: the loop drives the other ranks through a LeaderPolicy
        leader = await lead(policy, settings)
    except Exception as err:  # noqa: BLE001 - any failure to meet: a reported, clean end
        reason = f"trainer ranks could not meet: {type(err).__name__}: {err}"
        return await _report_failure(reporter, reason, log.bind(job_id=job_id))
    try:
        return await _run_rl(job_id, spec, launch, rollout, settings, reporter, status, leader)
    finally:
        await asyncio.to_thread(release, leader)


async def _run_rl(
    job_id: str,
    spec: JobSpec,
    launch: LaunchConfig,
    rollout: RolloutAddress,
    settings: TrainerSettings,
    reporter: SchedulerReporter,
    status: TrainerStatus,
    policy: Policy | LeaderPolicy,
) -> int:
    try:
        rollout_address = await rollout.resolve(
            default_timeout_s=settings.rollout_address_timeout_s
        )
    except RolloutError as err:
        return await _report_failure(reporter, str(err), log.bind(job_id=job_id))
    async with aio_channel(rollout_address, credential=launch.job_token) as rollout_channel:
        loop = RlLoop(
            job_id=job_id,
            spec=spec,
            policy=policy,
            rollout=GrpcRolloutSession(
                rollout_channel,
                address=rollout_address,
                weight_transport=settings.weight_transport,
            ),
            reporter=reporter,
            run_dir=Path(launch.run_dir),
            settings=settings,
            status=status,
            checkpoint_dir=launch.checkpoint_dir,
        )
        outcome = await loop.run()
    return outcome.exit_code


async def _infer(
    job_id: str,
    spec: JobSpec,
    launch: LaunchConfig,
    rollout: RolloutAddress,
    settings: TrainerSettings,
    reporter: SchedulerReporter,
) -> int:
    """An inference job: the rollout holds the model; no policy is loaded here."""
    try:
        rollout_address = await rollout.resolve(
            default_timeout_s=settings.rollout_address_timeout_s
        )
    except RolloutError as err:
        return await _report_failure(reporter, str(err), log.bind(job_id=job_id))
    async with aio_channel(rollout_address, credential=launch.job_token) as rollout_channel:
        job = InferenceJob(
            job_id=job_id,
            spec=spec,
            rollout=GrpcRolloutSession(rollout_channel, address=rollout_address),
            reporter=reporter,
            settings=settings,
        )
        outcome = await job.run()
    return 1 if outcome is Outcome.FAILED else 0


async def _report_failure(reporter: SchedulerReporter, reason: str, job_log) -> int:
    await report_failure_logged(reporter, reason, job_log)
    return 1
