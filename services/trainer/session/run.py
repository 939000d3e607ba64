"""A session job from start to end: load the policy, open the sampler, serve the session API,
publish the endpoint, wait for close or idle timeout, report how it ended."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import structlog
import torch
import transformers

from opentinker.errors import OpenTinkerError
from opentinker.grpc_options import host_port
from opentinker.services.common.auth import (
    IdentityServiceAuthenticator,
    OwnCredentialAuthenticator,
)
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.common.heap import freeze_loaded_heap
from opentinker.services.common.launch import LaunchConfig, write_atomic
from opentinker.services.modeling.preload import Preload
from opentinker.services.trainer.errors import RolloutError
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.reporter import SchedulerReporter, report_failure_logged
from opentinker.services.trainer.rollout_link.rollout_address import RolloutAddress
from opentinker.services.trainer.session.auth import SessionAuthenticator
from opentinker.services.trainer.session.host import SharedLoraHost
from opentinker.services.trainer.session.sampler import SessionSampler
from opentinker.services.trainer.session.training_session import RunWork, TrainingSession
from opentinker.services.trainer.settings import TrainerSettings
from opentinker.session_config import SessionConfig
from opentinker.spec import JobSpec, to_proto

log = structlog.get_logger(__name__)

# Builds and starts the TrainerService server for a session: (server, bound port).
ServeSession = Callable[
    [TrainerSettings, TrainingSession, SessionAuthenticator], Awaitable[tuple[grpc.aio.Server, int]]
]


async def run_session(
    launch: LaunchConfig,
    spec: JobSpec,
    rollout: RolloutAddress,
    settings: TrainerSettings,
    reporter: SchedulerReporter,
    serve: ServeSession,
    preload: Preload | None = None,
    host: SharedLoraHost | None = None,
) -> int:
    """Run the session to its end; the process exit code (0 when closed or idle, 1 failed).
    ``host``: a shared LoRA host the session joins (its adapter on the host's base, its model
    work in its turns there: host_process.py) instead of loading a policy of its own."""
    job = launch.job
    job_log = log.bind(job_id=job.job_id, attempt=job.attempt)
    config = spec.session or SessionConfig()
    run_work: RunWork | None = None
    try:
        if host is None:
            policy = await _load_policy(spec, config, settings, preload)
        else:
            tenant = await asyncio.to_thread(
                host.add_session, job.job_id, spec.model, seed=config.seed
            )
            policy = tenant  # type: ignore[assignment]  # a Policy's duck: host_tenant.py
            run_work = functools.partial(host.run, job.job_id)
    except (OSError, ValueError, OpenTinkerError) as err:
        reason = f"could not load model {spec.model.base_model!r}: {type(err).__name__}: {err}"
        return await _fail(reporter, reason, job_log)
    try:  # the rollout may still be starting (worker/job_run.py): its address comes now
        rollout_address = await rollout.resolve(
            default_timeout_s=settings.rollout_address_timeout_s
        )
    except RolloutError as err:
        return await _fail(reporter, str(err), job_log)
    async with (
        aio_channel(rollout_address, credential=launch.job_token) as rollout_channel,
        aio_channel(launch.scheduler_address) as identity_channel,
    ):
        sampler = SessionSampler(
            rollout_channel,
            address=rollout_address,
            tolerance=settings.probe_tolerance,
            weight_transport=settings.weight_transport,
        )
        try:
            await sampler.open(
                job_id=job.job_id,
                model=to_proto(spec).model,
                seed=config.seed,
                timeout_s=settings.open_timeout_s,
            )
            first = await sampler.publish(policy, timeout_s=settings.weight_sync_timeout_s)
            session = _training_session(
                launch, policy, sampler, config, settings, reporter, run_work
            )
            session.keep_snapshot(first)  # version 1, the starting weights, as every later
            server, port = await serve(settings, session, _authenticator(launch, identity_channel))
            try:
                return await _serve_until_ended(session, launch, settings, port, reporter)
            finally:
                await server.stop(grace=2.0)
        except OpenTinkerError as err:
            return await _fail(reporter, str(err), job_log)
        finally:
            await sampler.close(reason="session ended", timeout_s=settings.close_timeout_s)


def _training_session(
    launch: LaunchConfig,
    policy: Policy,
    sampler: SessionSampler,
    config: SessionConfig,
    settings: TrainerSettings,
    reporter: SchedulerReporter,
    run_work: RunWork | None,
) -> TrainingSession:
    job = launch.job
    checkpoint_dir = Path(launch.checkpoint_dir or Path(launch.run_dir) / "checkpoints")
    return TrainingSession(
        job_id=job.job_id,
        tenant_id=job.tenant_id,
        policy=policy,
        sampler=sampler,
        config=config,
        checkpoint_root=checkpoint_dir.resolve().parent,  # every job's folder is in it
        settings=settings,
        report_step=reporter.report_step,
        run_work=run_work,
    )


def _authenticator(
    launch: LaunchConfig, identity_channel: grpc.aio.Channel
) -> SessionAuthenticator:
    """The session's callers: its own job credential, or a key the scheduler vouches for."""
    job = launch.job
    return SessionAuthenticator(
        OwnCredentialAuthenticator(launch.job_token, job_id=job.job_id, attempt=job.attempt),
        IdentityServiceAuthenticator(identity_channel, address=launch.scheduler_address),
    )


async def _load_policy(
    spec: JobSpec, config: SessionConfig, settings: TrainerSettings, preload: Preload | None
) -> Policy:
    """The session's model and AdamW (its hyperparameters come with each optim_step)."""
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(config.seed)
    preloaded = preload.take(spec.model.base_model) if preload is not None else None
    policy = await asyncio.to_thread(
        Policy,
        spec.model,
        learning_rate=1e-5,  # replaced by each optim_step's AdamParams
        device=settings.device,
        preloaded=preloaded,
        seed=config.seed,
    )
    freeze_loaded_heap("policy")
    return policy


async def _serve_until_ended(
    session: TrainingSession,
    launch: LaunchConfig,
    settings: TrainerSettings,
    port: int,
    reporter: SchedulerReporter,
) -> int:
    endpoint = host_port(settings.host, port)
    write_atomic(Path(launch.run_dir) / "trainer.addr", endpoint)
    await reporter.report_session(endpoint=endpoint)
    session.log.info("session_serving", endpoint=endpoint)
    idle = asyncio.create_task(session.watch_idle())
    usage = asyncio.create_task(_report_usage(session, reporter, settings.session_usage_report_s))
    try:
        await session.ended.wait()
    finally:
        idle.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await idle
        await usage  # it ends with the session, after the report it may be sending
    await asyncio.sleep(0.2)  # let the answer to CloseSession leave before the server stops
    await session.flush_reports()  # the steps' reports go out before the session's end
    # What it sampled and trained since its last report (a step's, the periodic one's) is
    # counted with its end.
    generated, trained = session.take_unreported_tokens()
    await reporter.report_session(
        ended_reason=session.end_reason, tokens_generated=generated, tokens_trained=trained
    )
    final = {"steps": float(session.step), "policy_version": float(session.sampler.policy_version)}
    await reporter.report_result("", final)
    return 0


async def _report_usage(
    session: TrainingSession, reporter: SchedulerReporter, every_s: float
) -> None:
    """Every ``every_s`` until the session ends, the tokens it sampled and trained since its
    last report (SessionReport without an end): a session that only samples, and one between
    steps, reported them only at its end, all lost if its trainer died first. Never
    cancelled mid-report, so a report that reached the scheduler is never counted twice."""
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(session.ended.wait(), every_s)
        if session.ended.is_set():
            return
        generated, trained = session.take_unreported_tokens()
        if not (generated or trained):
            continue
        try:
            stop = await reporter.report_session(tokens_generated=generated, tokens_trained=trained)
        except Exception as err:  # the scheduler away: the next report carries them
            session.untake_tokens(generated, trained)
            session.log.warning("session_usage_not_reported", error=str(err))
            continue
        if stop:  # the job was cancelled or superseded: no later call is served
            session.end("stopped by the scheduler")


async def _fail(reporter: SchedulerReporter, reason: str, job_log) -> int:
    await report_failure_logged(reporter, reason, job_log, event="session_failed")
    return 1
