"""Active jobs that no lease holds: their attempts are stopped and the jobs re-queued.

Every path that ends an attempt's lease writes the ledger first and the job second (release or
drain, then re-queue), and a placement takes its lease before it moves the job to ALLOCATING.
A scheduler that dies between the two writes, or a commit whose reply is lost (its undo then
releases the lease of a placement that did commit), leaves a job ALLOCATING or RUNNING with no
lease: nothing renews, lapses or re-queues it, and it stays active for good.

``UnleasedSweep`` finds such jobs (``JobStore.active_ids`` against every lease in the ledger,
live, lapsed or draining). A job is acted on only when two sweeps at least ``grace_s`` apart
found it so, at the same attempt and unchanged: an exit releases its lease a moment before
the job's end is written, and one sighting of that moment must not re-run a finished job.
It then tells the attempt's workers to stop it and re-queues the job as a lost attempt.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import structlog

from opentinker.common.v1 import common_pb2
from opentinker.services.scheduler.jobs.job_lifecycle import ACTIVE_STATES
from opentinker.services.scheduler.jobs.job_store import JobStore
from opentinker.services.scheduler.leases.lease_ledger import LeaseLedger

log = structlog.get_logger(__name__)

Requeue = Callable[[str, str, str], Awaitable[None]]  # (job_id, worker_id, why)
StopAttempt = Callable[[str, str, int, str], Awaitable[None]]  # (worker, job, attempt, why)

WHY = "no lease holds its devices (the scheduler lost it)"


class UnleasedSweep:
    def __init__(
        self, jobs: JobStore, ledger: LeaseLedger, *, grace_s: float, stop: StopAttempt,
        requeue: Requeue,
    ) -> None:  # fmt: skip
        self._jobs = jobs
        self._ledger = ledger
        self.grace_s = grace_s
        self._stop = stop
        self._requeue = requeue
        self._next_at = 0.0  # monotonic
        self._seen: dict[str, tuple[int, float]] = {}  # job id -> (attempt, updated) last sweep

    async def sweep(self) -> list[str]:
        """At most once every ``grace_s``: stop and re-queue the jobs the last sweep found
        unleased and this one still does; the ids of those re-queued."""
        if time.monotonic() < self._next_at:
            return []
        self._next_at = time.monotonic() + self.grace_s
        found = {(job.job_id): job for job in await self._unleased()}
        confirmed = [
            job
            for job_id, job in found.items()
            if self._seen.get(job_id) == (job.attempt, job.updated_unix_s)
        ]
        self._seen = {job_id: (job.attempt, job.updated_unix_s) for job_id, job in found.items()}
        for job in confirmed:
            await self._stop_and_requeue(job)
            self._seen.pop(job.job_id, None)
        return [job.job_id for job in confirmed]

    async def _unleased(self) -> list[common_pb2.Job]:
        active = await self._jobs.active_ids()
        if not active:
            return []
        leased = {lease.job_id for lease in await self._ledger.all_leases()}
        candidates = [job_id for job_id in active if job_id not in leased]
        jobs = await self._jobs.get_many(candidates) if candidates else []
        return [job for job in jobs if job is not None and job.state in ACTIVE_STATES]

    async def _stop_and_requeue(self, job: common_pb2.Job) -> None:
        workers = [job.worker_id, *(w for w in job.worker_ids if w != job.worker_id)]
        log.warning("active_job_without_lease", job_id=job.job_id, attempt=job.attempt,
                    state=common_pb2.JobState.Name(job.state), workers=workers)  # fmt: skip
        for worker_id in workers:
            if worker_id:
                await self._stop(worker_id, job.job_id, job.attempt, WHY)
        await self._requeue(job.job_id, job.worker_id, WHY)
