"""The scheduler's logic: jobs, the queue, leases, workers. Knows nothing of gRPC.

Life of a job: ``submit`` stores it QUEUED and queues it. The dispatch loop takes queued jobs in
order and, for the first connected worker with enough free devices, acquires a lease (atomic),
moves the job to ALLOCATING (one more attempt) and sends the worker a LaunchCommand. The worker
reports ``job_launched`` (RUNNING) and ``job_exited`` (SUCCEEDED with the result the trainer
reported, or FAILED with the best reason known). A worker that closes or stops heartbeating
is lost: its jobs go back to the front of the queue, with their attempt count, and resume
elsewhere from their last checkpoint. So does a job whose trainer or rollout process was
killed (an infrastructure fault, not a failure the trainer reported). After ``max_attempts``
lost attempts the job fails with the history of why. A worker whose stream merely dropped
keeps its jobs running: its leases stay until they lapse, and when it reconnects in time it
re-announces its attempts and the scheduler adopts those it still owns (recovery.py). After a
start or a Redis outage the scheduler waits ``reconnect_grace_s`` for workers to come back
before it re-queues their lapsed leases. An attempt the scheduler stops (cancelled, re-queued)
changes its job's state at once, but keeps its devices held until its processes exited
(draining.py). Devices go to tenants fairly and within their quotas (fair_share.py,
quotas.py). Every state change is appended to the job's event log. A session job whose opening
API key is revoked is cancelled within a round (revoked_sessions.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import structlog

from opentinker.common.v1 import common_pb2
from opentinker.errors import PermissionDeniedError
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker.services.common.auth import Principal
from opentinker.services.common.revocation import while_not_revoked
from opentinker.services.common.waiting import wait_event
from opentinker.services.scheduler.errors import (
    IllegalTransitionError,
    JobNotFoundError,
)
from opentinker.services.scheduler.jobs.attempt_ends import AttemptEnds
from opentinker.services.scheduler.jobs.event_log import state_change
from opentinker.services.scheduler.jobs.job_lifecycle import TERMINAL_STATES, state_name
from opentinker.services.scheduler.jobs.job_store import JobPage
from opentinker.services.scheduler.jobs.progress import ProgressReports
from opentinker.services.scheduler.jobs.recovery import HeldAttempt, WorkerRecovery
from opentinker.services.scheduler.jobs.spec_paths import check_submission
from opentinker.services.scheduler.jobs.transitions import JobStates
from opentinker.services.scheduler.leases.draining import Drains
from opentinker.services.scheduler.model_admission import admit_model
from opentinker.services.scheduler.overview import Overview
from opentinker.services.scheduler.placement.dispatch import Dispatcher
from opentinker.services.scheduler.placement.spanning import holds_part
from opentinker.services.scheduler.placement.worker_session import (
    CloseCommand,
    DeviceOffer,
    StopCommand,
    WorkerSession,
)
from opentinker.services.scheduler.stores import Stores
from opentinker.services.scheduler.tenants.quotas import Quotas
from opentinker.services.scheduler.tenants.revoked_sessions import (
    revoked_reason,
    sessions_of_revoked_keys,
)
from opentinker.services.scheduler.tenants.worker_admission import admit_identity, refuse_if_alive

log = structlog.get_logger(__name__)

QUEUED = common_pb2.JOB_STATE_QUEUED
ALLOCATING = common_pb2.JOB_STATE_ALLOCATING
RUNNING = common_pb2.JOB_STATE_RUNNING
SUCCEEDED = common_pb2.JOB_STATE_SUCCEEDED
FAILED = common_pb2.JOB_STATE_FAILED
CANCELLED = common_pb2.JOB_STATE_CANCELLED


class Scheduler:
    """Owns jobs and workers. Call ``start()`` before serving and ``close()`` at shutdown."""

    def __init__(
        self,
        stores: Stores,
        *,
        heartbeat_interval_s: float,
        lease_ttl_s: float,
        max_attempts: int = 3,
        unschedulable_after_s: float = 300.0,
        reconnect_grace_s: float = 0.0,
        drain_timeout_s: float = 60.0,
        state_intact: Callable[[], Awaitable[bool]] | None = None,
        shared_lora_sessions: int = 0,
    ) -> None:
        self._jobs = stores.jobs
        self._queue = stores.queue
        self._ledger = stores.ledger
        self._events = stores.events
        self._identity = stores.identity
        self.models = stores.models  # the model catalog, read at submit and served as is
        self._quotas = Quotas(stores.identity, stores.usage, stores.ledger, stores.jobs)
        self._states = JobStates(stores.jobs, stores.events, stores.identity)
        self.reports = ProgressReports(stores.jobs, stores.events, self._quotas)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.lease_ttl_s = lease_ttl_s
        self._sessions: dict[str, WorkerSession] = {}
        placing = asyncio.Lock()  # a dispatch round, a re-queue or a submit: one at a time
        self._placing = placing
        self._drains = Drains(
            stores.ledger, self._sessions, timeout_s=drain_timeout_s, wake=self.wake
        )
        self._ends = AttemptEnds(
            stores,
            self._states,
            self._sessions,
            self._drains,
            max_attempts=max_attempts,
            wake=self.wake,
            placing=placing,
        )
        self._dispatcher = Dispatcher(
            stores,
            self._quotas,
            self._states,
            self._sessions,
            unschedulable_after_s=unschedulable_after_s,
            placing=placing,
            shared_lora_sessions=shared_lora_sessions,
        )
        self._recovery = WorkerRecovery(
            self._jobs,
            self._ledger,
            self._sessions,
            self._drains,
            requeue=self._ends.requeue,
            mark_running=self._mark_running,
            reconnect_grace_s=reconnect_grace_s,
            unleased_after_s=2 * lease_ttl_s,
        )
        self.overview = Overview(self._sessions, self._ledger, self._jobs)  # read-only views
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._closing = False
        self._suspended = False  # Redis lost our state (lost_state.py): no round runs
        self._state_intact = state_intact or _always_intact

    # ---- life cycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run(), name="scheduler-loop")

    async def close(self, reason: str = "scheduler shutting down") -> None:
        """Stop the loop and ask every connected worker to close its stream."""
        self._closing = True  # ends the loop even if a library swallows the cancellation
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.wait({self._loop_task}, timeout=5.0)
            self._loop_task = None
        for session in list(self._sessions.values()):
            session.send(CloseCommand(reason))

    def suspend(self, reason: str) -> None:
        """Redis lost the scheduler's state (lost_state.py): no round runs until ``resume``
        (it would act on an empty ledger), and every connected worker is asked to close its
        stream. Its jobs keep running: nothing is stopped, nothing re-queued."""
        self._suspended = True
        log.error("scheduler_suspended", workers=sorted(self._sessions), reason=reason)
        for session in list(self._sessions.values()):
            session.send(CloseCommand(reason))

    def resume(self) -> None:
        """Redis holds a state again (restored, or re-bootstrapped): absent workers have the
        reconnect grace to re-announce their jobs, as after a start."""
        self._suspended = False
        self._recovery.open_grace()
        log.warning("scheduler_resumed")
        self.wake()

    def wake(self) -> None:
        """Run a dispatch round soon (a job was queued or devices were freed)."""
        self._wake.set()

    async def _run(self) -> None:
        tick = min(self.heartbeat_interval_s, self.lease_ttl_s / 2)
        self._recovery.open_grace()
        failures = 0
        while not self._closing:
            self._wake.clear()
            if self._suspended:
                await wait_event(self._wake, tick)
                continue
            try:
                if failures:
                    await self._recovery.after_outage()
                await self._drop_silent_workers()
                await self._recovery.requeue_lapsed()
                await self._drains.expire()
                await self._end_revoked_sessions()
                await self.dispatch()
                failures = 0
            except Exception as err:  # Redis briefly away, etc.: log and try again next tick
                failures += 1  # the traceback once, then one line per round
                log.warning("scheduler_round_failed", error=repr(err), exc_info=failures == 1)
            await wait_event(self._wake, tick)

    # ---- jobs -------------------------------------------------------------------------------

    async def submit(
        self, spec: common_pb2.JobSpec, *, owner: Principal, request_id: str = ""
    ) -> common_pb2.Job:
        """Validate (ConfigError naming the field) and queue a job of ``owner``'s tenant;
        idempotent on (tenant, request_id)."""
        await check_submission(spec, owner.tenant_id, self._jobs)
        spec = admit_model(spec, await self.models.list_models())  # model_admission.py
        await self._quotas.check_submit(spec, owner.tenant_id)
        async with self._placing:  # queued as it is stored: no round places it before its event
            job, created = await self._jobs.create(
                spec,
                request_id=request_id,
                tenant_id=owner.tenant_id,
                owner_user_id=owner.user_id,
                opened_by=_opening_key(spec, owner),
            )
            if created:
                await self._events.append(job.job_id, state_change(QUEUED, job.reason))
        if created:
            log.info("job_submitted", job_id=job.job_id, name=job.spec.name)
            self.wake()
        return job

    async def get(self, job_id: str, *, tenant: str | None) -> common_pb2.Job:
        """The job, if it belongs to ``tenant`` (None = any tenant); else JobNotFoundError,
        the same answer as for a job that does not exist."""
        job = await self._jobs.get(job_id)
        if tenant is not None and job.tenant_id != tenant:
            raise JobNotFoundError.for_id(job_id)
        if job.state == common_pb2.JOB_STATE_QUEUED:  # why it waits (queue_wait.py)
            position, reason = self._dispatcher.waiting.get(
                job_id, (0, "waiting for the next scheduling round")
            )
            job.queue_position, job.queue_reason = position, reason
        return job

    async def list_jobs(
        self, *, tenant: str | None, page_size: int = 0, page_token: str = ""
    ) -> JobPage:
        return await self._jobs.list_jobs(
            page_size=page_size, page_token=page_token, tenant_id=tenant
        )

    async def cancel(self, job_id: str, reason: str = "", *, tenant: str | None) -> common_pb2.Job:
        """QUEUED: cancelled at once. ALLOCATING/RUNNING: cancelled at once, and its worker told
        to stop it; its devices stay held until the worker reports its exit (draining.py). A
        finished job raises IllegalTransitionError."""
        reason = reason or "cancelled by request"
        job = await self.get(job_id, tenant=tenant)
        if job.state in TERMINAL_STATES:
            raise IllegalTransitionError(
                f"job {job_id!r} already ended ({state_name(job.state)}: {job.reason}); "
                "only queued or running jobs can be cancelled",
                reason="JOB_ENDED",
            )
        cancelled = await self._jobs.transition(job_id, CANCELLED, reason=reason)
        await self._identity.revoke_job_tokens(job_id)
        await self._queue.remove(job_id)
        await self._events.append(job_id, state_change(CANCELLED, reason))
        # Where it runs now, not where it ran when read: it may have been placed meanwhile.
        placed = cancelled.worker_ids or ([cancelled.worker_id] if cancelled.worker_id else [])
        for worker_id in placed:
            await self._drains.stop_attempt(worker_id, job_id, cancelled.attempt, reason)
        log.info("job_cancelled", job_id=job_id, was=state_name(job.state), reason=reason)
        return cancelled

    async def _end_revoked_sessions(self) -> None:
        """Cancel each session whose opening key was revoked (revoked_sessions.py)."""
        found = await sessions_of_revoked_keys(self._jobs, self._identity)
        if not found or not await self._state_intact():
            return  # none; or every key reads as gone because Redis lost our state
        for job_id, key_prefix in found.items():
            try:
                await self.cancel(job_id, revoked_reason(key_prefix), tenant=None)
            except (IllegalTransitionError, JobNotFoundError):
                continue  # it ended meanwhile

    async def usage(
        self, *, tenant: str | None, tenant_id: str = "", max_jobs: int = 0
    ) -> list[scheduler_pb2.TenantUsage]:
        """Usage of ``tenant`` (None = an admin: of ``tenant_id``, or of every tenant)."""
        if tenant is not None:
            if tenant_id and tenant_id != tenant:
                raise PermissionDeniedError(
                    f"tenant_id: you may see only your own tenant's usage ({tenant!r})",
                    reason="OTHER_TENANT",
                )
            tenant_ids = [tenant]
        elif tenant_id:
            tenant_ids = [tenant_id]
        else:
            tenant_ids = [
                t.tenant_id for t in (await self._identity.list_tenants(page_size=1000)).items
            ]
        held = await self._quotas.devices_in_use()
        return [
            await self._quotas.report(t, held.get(t, 0), max_jobs=max_jobs or 20)
            for t in tenant_ids
        ]

    async def watch(
        self, job_id: str, from_seq: int = 1, *, tenant: str | None, key_prefix: str = ""
    ) -> AsyncIterator[common_pb2.JobEvent]:
        """The job's events from ``from_seq``, live until it ends; JobNotFoundError first.
        ``key_prefix``: the caller's credential, checked again every heartbeat interval, so a
        watch ends (AuthenticationError) once its key is revoked."""
        await self.get(job_id, tenant=tenant)
        events = self._events.read(job_id, from_seq)
        if not key_prefix:
            return events
        return while_not_revoked(
            events,
            lambda: self._identity.is_revoked(key_prefix),
            every_s=self.heartbeat_interval_s,
        )

    # ---- workers ----------------------------------------------------------------------------

    async def connect_worker(
        self,
        worker_id: str,
        hostname: str,
        devices: Sequence[DeviceOffer],
        held: Sequence[HeldAttempt] = (),
    ) -> WorkerSession:
        """Register a worker's devices and reconcile the attempts it still holds (``held``):
        adopt those it still owns, stop strays, re-queue the jobs of leases it no longer holds.
        A worker id whose stream is alive and heartbeating is refused (AlreadyExistsError); one
        whose stream ended or stays silent is taken over (the new stream re-announces;
        worker_admission.py)."""
        await refuse_if_alive(
            self._sessions.get(worker_id), heartbeat_interval_s=self.heartbeat_interval_s
        )
        old = self._sessions.get(worker_id)
        if old is not None:
            await self.disconnect_worker(old, "replaced by a new connection")
            old.send(CloseCommand("replaced by a new connection from the same worker id"))
        session = WorkerSession(worker_id=worker_id, hostname=hostname, devices=tuple(devices))

        async def register() -> None:
            await self._ledger.register_worker(worker_id, [d.device_id for d in devices])
            self._sessions[worker_id] = session

        found = await self._recovery.adopt(session, held, register)
        log.info(
            "worker_connected",
            worker_id=worker_id,
            devices=[d.device_id for d in devices],
            adopted=sorted(f"{job}#{attempt}" for job, attempt in found.adopted),
            strays=[f"{h.job_id}#{h.attempt}" for h in found.strays],
            released=[lease.lease_id for lease in found.orphans],
        )
        self.wake()
        return session

    async def admit_worker(self, principal: Principal, worker_id: str) -> None:
        """PermissionDeniedError unless the worker token of ``principal`` admits ``worker_id``
        (binding a token made for no worker id to it at first use; worker_admission.py)."""
        await admit_identity(self._identity, principal, worker_id)

    def check_credential_soon(self, session: WorkerSession) -> None:
        """Check again, in the background, the credential the worker connected with; one check
        at a time, so a slow Redis never holds up the stream."""
        check = session.credential_check
        if session.key_prefix and not session.lost and (check is None or check.done()):
            session.credential_check = asyncio.create_task(self._cut_off_if_revoked(session))

    async def _cut_off_if_revoked(self, session: WorkerSession) -> None:
        """A worker whose credential was revoked since it connected is cut off: its attempts
        are told to stop and re-queued elsewhere, and its stream is closed."""
        try:
            if not await self._identity.is_revoked(session.key_prefix) or session.lost:
                return
            if not await self._state_intact():
                return  # not revoked: Redis lost every key (lost_state.py suspends us)
            reason = f"the worker's credential (key {session.key_prefix}) was revoked"
            for job_id, attempt in list(session.running):
                session.send(StopCommand(job_id, reason, attempt=attempt))
            await self.disconnect_worker(session, reason, reclaim=True)
            session.send(CloseCommand(reason))
        except Exception as err:  # Redis away: checked again at the next heartbeat
            log.warning("credential_check_failed", worker_id=session.worker_id, error=repr(err))

    def worker_seen(self, session: WorkerSession) -> None:
        """Any message from the worker counts as a heartbeat: renew its leases (soon)."""
        session.last_seen = time.monotonic()
        self._recovery.renew_soon(session)

    async def job_launched(self, session: WorkerSession, job_id: str, attempt: int) -> None:
        job = await self._jobs.get(job_id)
        current = job.attempt == attempt and holds_part(job, session.worker_id)
        if current and job.state == RUNNING and job.worker_ids:
            return  # another part of a multi-worker attempt was first
        if job.state != ALLOCATING or not current:
            # Cancelled or re-queued meanwhile: this attempt must not run. Name it: a newer
            # attempt of the job may run on this worker by now, and must go on.
            why = f"job is {state_name(job.state)}: {job.reason}"
            session.send(StopCommand(job_id, why, attempt=attempt))
            return
        reason = f"running on worker {session.worker_id}"
        await self._states.change(job_id, RUNNING, reason, expect_attempt=attempt)

    async def _mark_running(self, job_id: str, attempt: int, reason: str) -> None:
        """An adopted attempt whose JobLaunched was lost: its processes do run."""
        await self._states.change(job_id, RUNNING, reason, expect_attempt=attempt)

    async def job_exited(
        self, session: WorkerSession, job_id: str, attempt: int, exit_code: int, reason: str
    ) -> None:
        """Decide how the attempt ended (attempt_ends.py)."""
        await self._ends.exited(session, job_id, attempt, exit_code, reason)

    async def disconnect_worker(
        self,
        session: WorkerSession,
        reason: str,
        *,
        reclaim: bool = False,
        jobs_stopped: bool = False,
        closing: bool = False,
    ) -> None:
        """The session ended (``reason``). With ``reclaim`` (the worker closes, or went silent,
        or was cut off) its jobs are re-queued now, with "worker W shut down: <reason>" when it
        said it closes (``closing``), "worker W lost: <reason>" otherwise, their devices held
        (draining) until they lapse, or, ``jobs_stopped`` (it closed saying its processes
        exited), freed now; without (the stream dropped, the
        scheduler shuts down) its jobs keep running: their leases stay until they lapse, or
        until it reconnects and re-announces them. Idempotent; a no-op once replaced."""
        if session.lost:
            return
        session.lost = True
        session.running.clear()
        worker_id = session.worker_id
        if self._sessions.get(worker_id) is not session:
            return
        del self._sessions[worker_id]
        await self._ledger.unregister_worker(worker_id)
        why = f"worker {worker_id} {'shut down' if closing else 'lost'}: {reason}"
        if reclaim:
            await self._recovery.reclaim(worker_id, why, jobs_stopped=jobs_stopped)
        if closing:
            log.info("worker_closed", worker_id=worker_id, reason=reason)
        else:
            log.warning("worker_lost", worker_id=worker_id, reason=reason, reclaimed=reclaim)
        self.wake()

    async def devices_in_use(self) -> dict[str, int]:
        """Devices each tenant's jobs hold now, on any worker (every unreleased lease)."""
        return await self._quotas.devices_in_use()

    def connected_workers(self) -> list[str]:
        return sorted(self._sessions)

    async def dispatch(self) -> int:
        """Launch what fits now (dispatch.py); returns how many jobs were launched."""
        return await self._dispatcher.dispatch()

    # ---- recovery ---------------------------------------------------------------------------

    async def _drop_silent_workers(self) -> None:
        now = time.monotonic()
        for session in list(self._sessions.values()):
            silent_s = now - session.last_seen
            if silent_s > self.lease_ttl_s:
                reason = f"no heartbeat for {silent_s:.1f} s"
                await self.disconnect_worker(session, reason, reclaim=True)
                session.send(CloseCommand(reason))


async def _always_intact() -> bool:
    return True


def _opening_key(spec: common_pb2.JobSpec, owner: Principal) -> str:
    """The key prefix a session job is ended with when it is revoked (revoked_sessions.py);
    "" for other jobs, and for a session not opened with a user's API key."""
    session = spec.kind == common_pb2.JOB_KIND_SESSION
    return owner.key_prefix if session and owner.kind == "user" else ""
