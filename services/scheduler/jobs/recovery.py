"""Reconciling a reconnecting worker: which attempts it still runs are still the scheduler's.

A worker keeps its jobs running while its stream to the scheduler is down (a dropped connection,
a scheduler restart, a Redis restart) and re-announces them when it registers again
(``RegisterWorker.held``). ``reconcile`` decides, from the lease ledger and the job store:

- adopt an announced attempt whose lease the ledger still knows (not released) for this worker
  and job, whose job is still ALLOCATING/RUNNING with that attempt on this worker, and whose
  devices no other lease took meanwhile (the lease is revived: held again for a TTL);
- stop a stray: an announced attempt that is not adopted and still runs;
- re-queue an orphan: a lease of this worker that it no longer announces (its launch was lost,
  or the attempt ended and was forgotten), unless its job was adopted under another lease;
- a draining lease (its attempt was told to stop, draining.py) stays held while the worker
  announces the attempt still running (which is told to stop again); announced exited, or not
  announced, its processes are gone: it is released, its job left as it is.

``WorkerRecovery`` applies the decisions, and owns the other ways leases come back: a worker
that closes or goes silent (reclaim), and leases that lapsed (re-queue; right after a start or
a Redis outage only once ``reconnect_grace_s`` has given absent workers time to come back). A
lost attempt whose processes may still run keeps its devices held (draining) while its job is
re-queued at once; a draining lease that lapses is released.
Nothing here knows gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from opentinker.common.v1 import common_pb2
from opentinker.errors import OpenTinkerError
from opentinker.services.scheduler.errors import JobNotFoundError
from opentinker.services.scheduler.jobs.job_lifecycle import ACTIVE_STATES
from opentinker.services.scheduler.jobs.job_store import JobStore
from opentinker.services.scheduler.leases.draining import Drains
from opentinker.services.scheduler.leases.lease_ledger import Lease, LeaseLedger
from opentinker.services.scheduler.leases.unleased import UnleasedSweep
from opentinker.services.scheduler.placement.spanning import holds_part
from opentinker.services.scheduler.placement.worker_session import StopCommand, WorkerSession

log = structlog.get_logger(__name__)

Requeue = Callable[..., Awaitable[None]]  # (job_id, worker_id[, why])
MarkRunning = Callable[[str, int, str], Awaitable[object]]  # (job_id, attempt, reason)


@dataclass(frozen=True)
class HeldAttempt:
    """One attempt a reconnecting worker still holds (RegisterWorker.held)."""

    job_id: str
    attempt: int
    lease_id: str
    launched: bool = False  # its processes started (the JobLaunched may have been lost)
    exited: bool = False  # it has ended; its JobExited follows the registration


@dataclass
class Reconciliation:
    """What to do with a reconnecting worker's attempts and leases."""

    adopted: dict[tuple[str, int], str] = field(default_factory=dict)  # -> lease_id
    now_running: list[tuple[str, int]] = field(default_factory=list)  # ALLOCATING, launched
    strays: list[HeldAttempt] = field(default_factory=list)  # still running: stop them
    orphans: list[Lease] = field(default_factory=list)  # release; re-queue unless adopted
    drained: list[Lease] = field(default_factory=list)  # draining, processes gone: release

    @property
    def adopted_jobs(self) -> set[str]:
        return {job_id for job_id, _ in self.adopted}


async def reconcile(
    jobs: JobStore, ledger: LeaseLedger, worker_id: str, held: Sequence[HeldAttempt]
) -> Reconciliation:
    """Decide (and revive the adopted leases); the caller holds the scheduler's recovery lock
    so that no lapsed-lease sweep runs in between."""
    announced = {h.lease_id: h for h in held}
    out = Reconciliation()
    for lease in await ledger.leases(worker_id):
        h = announced.pop(lease.lease_id, None)
        if lease.drain is not None:
            await _still_draining(ledger, lease, h, out)
            continue
        job = (
            await _owned(jobs, worker_id, h) if h is not None and h.job_id == lease.job_id else None
        )
        if h is None or job is None or not await ledger.revive(lease.lease_id, worker_id, h.job_id):
            out.orphans.append(lease)
            if h is not None and not h.exited:
                out.strays.append(h)
            continue
        out.adopted[(h.job_id, h.attempt)] = lease.lease_id
        if h.launched and job.state == common_pb2.JOB_STATE_ALLOCATING:
            out.now_running.append((h.job_id, h.attempt))
    # Announced under a lease the ledger no longer knows: released (job re-queued, cancelled).
    out.strays.extend(h for h in announced.values() if not h.exited)
    return out


async def _still_draining(
    ledger: LeaseLedger, lease: Lease, h: HeldAttempt | None, out: Reconciliation
) -> None:
    """A draining lease stays held while its attempt still runs there (stopped again)."""
    assert lease.drain is not None
    running = h is not None and not h.exited and h.attempt == lease.drain.attempt
    if h is not None and running and await ledger.revive(lease.lease_id, lease.worker_id, h.job_id):
        out.strays.append(h)
    else:
        out.drained.append(lease)
        if h is not None and not h.exited:
            out.strays.append(h)


async def _owned(jobs: JobStore, worker_id: str, h: HeldAttempt) -> common_pb2.Job | None:
    """The job if that attempt is still its current, active one on this worker."""
    try:
        job = await jobs.get(h.job_id)
    except JobNotFoundError:
        return None
    if job.state in ACTIVE_STATES and job.attempt == h.attempt and holds_part(job, worker_id):
        return job
    return None


class WorkerRecovery:
    """Gives leases back to their jobs or to the queue. ``requeue`` puts an active job of a
    lost worker back in the queue; ``mark_running`` moves an ALLOCATING attempt to RUNNING.
    ``sessions`` is the scheduler's live map of connected workers (read only here)."""

    def __init__(
        self,
        jobs: JobStore,
        ledger: LeaseLedger,
        sessions: Mapping[str, WorkerSession],
        drains: Drains,
        *,
        requeue: Requeue,
        mark_running: MarkRunning,
        reconnect_grace_s: float,
        unleased_after_s: float = 60.0,
    ) -> None:
        self._jobs = jobs
        self._ledger = ledger
        self._sessions = sessions
        self._drains = drains
        self._requeue = requeue
        self._mark_running = mark_running
        self.reconnect_grace_s = reconnect_grace_s
        self._grace_until = 0.0  # monotonic; until then lapsed leases of absent workers wait
        self._seen: set[str] = set()  # workers connected since the grace opened
        self._lock = asyncio.Lock()  # reconcile vs. the lapsed-lease sweep vs. reclaim
        self._unleased = UnleasedSweep(
            jobs, ledger, grace_s=unleased_after_s, stop=drains.stop_attempt, requeue=requeue
        )

    def open_grace(self) -> None:
        """From now, absent workers have ``reconnect_grace_s`` to re-announce their jobs."""
        self._grace_until = time.monotonic() + self.reconnect_grace_s
        self._seen = set(self._sessions)

    async def adopt(
        self,
        session: WorkerSession,
        held: Sequence[HeldAttempt],
        register: Callable[[], Awaitable[None]],
    ) -> Reconciliation:
        """Reconcile a (re)connecting worker and apply it to its new session; ``register``
        makes the session dispatchable, under the same lock."""
        async with self._lock:
            found = await reconcile(self._jobs, self._ledger, session.worker_id, held)
            await self._settle(session, found)
            await register()
            self._seen.add(session.worker_id)
        return found

    async def _settle(self, session: WorkerSession, found: Reconciliation) -> None:
        worker_id = session.worker_id
        for lease in found.drained:
            await self._drains.end(lease, "its worker no longer runs the attempt")
        for lease in found.orphans:  # released before re-queued: never two leases of a job
            await self._ledger.release(lease.lease_id)
            if lease.job_id not in found.adopted_jobs:
                await self._requeue(lease.job_id, worker_id)
        for job_id, attempt in found.now_running:
            with contextlib.suppress(OpenTinkerError):  # moved on meanwhile: its exit settles it
                await self._mark_running(job_id, attempt, f"running on worker {worker_id}")
        session.running.update(found.adopted)
        for stray in found.strays:
            why = "this attempt is no longer the scheduler's (re-queued, cancelled or ended)"
            session.send(StopCommand(stray.job_id, why, attempt=stray.attempt))

    def renew_soon(self, session: WorkerSession) -> None:
        """Renew the worker's leases in the background, one renewal at a time, so a slow or
        absent Redis never holds up reading its messages or makes a live worker look silent."""
        if not session.lost and (session.renewal is None or session.renewal.done()):
            session.renewal = asyncio.create_task(self._renew(session.worker_id))

    async def _renew(self, worker_id: str) -> None:
        try:
            await self._ledger.renew(worker_id)
        except Exception as err:  # Redis away: the next heartbeat renews (or it is revived)
            log.warning("lease_renew_failed", worker_id=worker_id, error=repr(err))

    async def reclaim(self, worker_id: str, why: str, *, jobs_stopped: bool = False) -> None:
        """The worker closed or went silent (``why``, the jobs' re-queue reason: "worker w1
        shut down: …" or "worker w1 lost: no heartbeat …"): re-queue the jobs of all its
        leases now. Its
        processes may still run: what the leases still hold stays held (draining) until the
        worker, back within a lease TTL, says they exited; else the holds lapse, nothing
        renewing them (a silent worker's have lapsed already: they are not held again).
        ``jobs_stopped``: the worker closed saying every process it ran has exited, so nothing
        is held: its leases, draining ones too, are released at once."""
        async with self._lock:
            if jobs_stopped:
                await self._release_stopped(worker_id, why)
                return
            for lease in await self._ledger.leases(worker_id):
                if lease.drain is not None:
                    continue
                try:
                    attempt = (await self._jobs.get(lease.job_id)).attempt
                except JobNotFoundError:
                    await self._ledger.release(lease.lease_id)
                    continue
                await self._drains.hold(lease, attempt, why, rehold=False)
                await self._requeue(lease.job_id, worker_id, why)

    async def _release_stopped(self, worker_id: str, why: str) -> None:
        """Release the leases of a worker whose processes all exited; re-queue their jobs
        (released first: never two leases of a job)."""
        released = []
        for lease in await self._ledger.leases(worker_id):
            if lease.drain is not None:  # a stopped attempt whose JobExited was never sent
                await self._drains.end(lease, f"worker {worker_id} closed, its processes gone")
                continue
            if await self._ledger.release(lease.lease_id):
                released.append(lease.lease_id)
            await self._requeue(lease.job_id, worker_id, why)
        log.info("worker_closed_jobs_stopped", worker_id=worker_id, released=released)

    async def requeue_lapsed(self) -> None:
        """Re-queue the jobs of lapsed leases; during the grace, not those of workers that have
        not connected since the scheduler started or Redis came back. After the grace, also
        the active jobs that no lease holds (unleased.py)."""
        async with self._lock:
            waiting = time.monotonic() < self._grace_until
            for lease in await self._ledger.lapsed():
                if waiting and lease.worker_id not in self._seen:
                    continue  # not back since the restart/outage: it may still re-announce it
                await self._requeue_lapsed(lease)
            if not waiting:
                await self._unleased.sweep()

    async def _requeue_lapsed(self, lease: Lease) -> None:
        """Re-queue the job of a lapsed lease. Its worker, if connected, still runs the attempt:
        the devices are held for it (draining) and the worker told to stop it. A lapsed drain
        ends: its worker is lost."""
        if lease.drain is not None:
            await self._drains.end(lease, "lapsed: its worker no longer renews it")
            return
        reason = "lease lapsed; job re-queued"
        session = self._sessions.get(lease.worker_id)
        runs = []
        if session is not None:
            runs = [k for k, i in session.running.items() if i == lease.lease_id]
        if runs:  # held before its runs are forgotten: an exit meanwhile still releases it
            await self._drains.hold(lease, runs[0][1], reason)
        else:
            await self._ledger.release(lease.lease_id)
        if session is not None:  # forgotten before the re-queue may place the job again
            for key in runs:
                session.running.pop(key, None)
        await self._requeue(lease.job_id, lease.worker_id)
        if session is not None:
            for _, attempt in runs:
                session.send(StopCommand(lease.job_id, reason, attempt=attempt))

    async def after_outage(self) -> None:
        """Redis is back after failed rounds, and leases may have lapsed meanwhile: hold the
        known leases of connected workers again (draining ones too), and give absent workers
        the grace."""
        self.open_grace()
        for session in list(self._sessions.values()):
            for (job_id, _), lease_id in list(session.running.items()):
                await self._ledger.revive(lease_id, session.worker_id, job_id)
        for lease in await self._ledger.draining():
            if lease.worker_id in self._sessions:
                await self._ledger.revive(lease.lease_id, lease.worker_id, lease.job_id)
        log.info("scheduler_recovered", grace_s=self.reconnect_grace_s)
