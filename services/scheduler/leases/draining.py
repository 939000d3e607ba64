"""Draining: the devices of an attempt told to stop stay held until its processes are gone.

When the scheduler stops an attempt whose processes may still run (its job was cancelled, its
lease lapsed while its worker still ran it, its worker was reclaimed, another part of its
multi-worker attempt ended), the job's state changes at once (CANCELLED, re-QUEUED), but its
lease is not released: it is marked *draining* (lease_ledger.py) before the worker is told to
stop. Its devices stay held, so no job is placed on a GPU that still holds the stopped
processes' memory during their SIGTERM grace (a CUDA out-of-memory, or vLLM sizing its
``gpu_memory_utilization`` against memory not yet freed), as SLURM keeps a node COMPLETING and
Kubernetes keeps a terminating pod's resources until its containers are gone.

The hold ends (the lease is released, and a dispatch round runs) when
- the worker reports the attempt's exit (JobExited; or, registering again, announces it exited
  or no longer announces it: recovery.py), or closes saying every process it ran has exited
  (``WorkerClosing.jobs_stopped``: a clean shutdown stops the jobs first; recovery.py);
- ``timeout_s`` (the ``drain_timeout_s`` setting) passed since the stop with no report: a worker
  that heartbeats but never reports cannot hold devices for ever;
- the lease lapses: its worker is lost and nothing renews it (the lapsed-lease sweep).

Accounting: a draining lease is charged to the stopped job until it is released, and counts in
its tenant's devices in use (accounted_ledger.py): its processes hold the devices until then.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import structlog

from opentinker.services.scheduler.leases.lease_ledger import Lease, LeaseLedger
from opentinker.services.scheduler.placement.worker_session import StopCommand, WorkerSession

log = structlog.get_logger(__name__)


class Drains:
    """Holds stopped attempts' leases and ends the holds; ``wake``: a dispatch round soon.
    ``sessions`` is the scheduler's live map of connected workers."""

    def __init__(
        self,
        ledger: LeaseLedger,
        sessions: Mapping[str, WorkerSession],
        *,
        timeout_s: float,
        wake: Callable[[], None],
    ) -> None:
        self.ledger = ledger
        self._sessions = sessions
        self.timeout_s = timeout_s
        self._wake = wake

    async def hold(self, lease: Lease, attempt: int, reason: str, *, rehold: bool = True) -> None:
        """Keep ``lease`` held for its stopped ``attempt`` (``rehold``: its lapsed devices no
        other lease took too). Called before the worker is told to stop, so an exit it
        reports at once finds the hold to end."""
        if await self.ledger.drain(lease.lease_id, attempt, reason, rehold=rehold):
            log.info(
                "lease_draining",
                lease_id=lease.lease_id,
                job_id=lease.job_id,
                attempt=attempt,
                worker_id=lease.worker_id,
                devices=list(lease.device_ids),
                reason=reason,
            )

    async def stop_attempt(self, worker_id: str, job_id: str, attempt: int, reason: str) -> None:
        """Stop the job's ``attempt`` on ``worker_id``: hold the job's leases there (draining),
        forget its runs, and tell the worker, if connected, to stop it where it ran it or held a
        lease of the job."""
        leases = [
            lease
            for lease in await self.ledger.leases(worker_id)
            if lease.job_id == job_id and lease.drain is None
        ]
        for lease in leases:
            await self.hold(lease, attempt, reason)
        session = self._sessions.get(worker_id)
        if session is None:
            return
        if session.forget(job_id) or leases:
            session.send(StopCommand(job_id, reason, attempt=attempt))

    async def exited(self, worker_id: str, job_id: str, attempt: int) -> None:
        """The worker reports the attempt's processes exited: end its drain there, if any."""
        for lease in await self.ledger.leases(worker_id):
            drain = lease.drain
            if lease.job_id == job_id and drain is not None and drain.attempt == attempt:
                await self.end(lease, "its processes exited")

    async def expire(self) -> None:
        """End the drains no exit was reported for within ``timeout_s``."""
        now = time.time()
        for lease in await self.ledger.draining():
            if lease.drain is not None and now - lease.drain.since_unix_s >= self.timeout_s:
                why = f"no exit reported within {self.timeout_s:g} s"
                await self.end(lease, why, timed_out=True)

    async def end(self, lease: Lease, why: str, *, timed_out: bool = False) -> None:
        """Release a draining lease: its devices are free for the next dispatch round. A drain
        that ``timed_out`` is a warning: the stopped processes may still hold the devices."""
        if not await self.ledger.release(lease.lease_id):
            return  # another path ended it first
        drained_s = time.time() - lease.drain.since_unix_s if lease.drain else 0.0
        (log.warning if timed_out else log.info)(
            "lease_drained",
            lease_id=lease.lease_id,
            job_id=lease.job_id,
            attempt=lease.drain.attempt if lease.drain else 0,
            worker_id=lease.worker_id,
            drained_s=round(drained_s, 3),
            why=why,
        )
        self._wake()
