"""How an attempt ends: the worker says its processes exited, or the attempt was lost.

``exited``: a result and exit code 0 is SUCCEEDED; a process killed by a signal is an
infrastructure fault, re-queued to resume from its last checkpoint, and so is a trainer that
exits ``exit_codes.RETRY_LATER`` (its checkpoint root failed it, and the operator chose
on_storage_error=requeue; the reason it reported is the attempt's); anything else (the trainer
reported a failure, or exited non-zero by itself) is FAILED. ``requeue``: an active job whose
attempt was lost (its worker closed or went silent, a process was killed) goes back to the
front of the queue with its attempt count; after ``max_attempts`` lost attempts it fails with
the history of why. The parts of a multi-worker attempt end together (spanning.py). The exit
of an attempt the scheduler had stopped ends the hold on its devices (draining.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from opentinker.common.v1 import common_pb2
from opentinker.errors import OpenTinkerError
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker.services.scheduler.jobs.attempts import (
    asks_for_retry,
    attempt_history,
    ended_by_signal,
)
from opentinker.services.scheduler.jobs.job_lifecycle import ACTIVE_STATES, state_name
from opentinker.services.scheduler.jobs.transitions import JobStates
from opentinker.services.scheduler.leases.draining import Drains
from opentinker.services.scheduler.placement.spanning import end_parts, holds_part
from opentinker.services.scheduler.placement.worker_session import WorkerSession
from opentinker.services.scheduler.stores import Stores

log = structlog.get_logger(__name__)

QUEUED = common_pb2.JOB_STATE_QUEUED
SUCCEEDED = common_pb2.JOB_STATE_SUCCEEDED
FAILED = common_pb2.JOB_STATE_FAILED


class AttemptEnds:
    """Decides what becomes of a job when its attempt ends; ``wake``: a dispatch round soon."""

    def __init__(
        self,
        stores: Stores,
        states: JobStates,
        sessions: dict[str, WorkerSession],
        drains: Drains,
        *,
        max_attempts: int,
        wake: Callable[[], None],
        placing: asyncio.Lock,
    ) -> None:
        self._jobs = stores.jobs
        self._queue = stores.queue
        self._ledger = stores.ledger
        self._states = states
        self._sessions = sessions
        self._drains = drains
        self.max_attempts = max_attempts
        self._wake = wake
        # The dispatcher's: a re-queue is written whole (state, queue, tokens, event) before
        # a dispatch round may place the job again.
        self._placing = placing

    async def exited(
        self, session: WorkerSession, job_id: str, attempt: int, exit_code: int, reason: str
    ) -> None:
        """The attempt's processes on ``session``'s worker exited; its lease is released
        first, whatever happened (a stopped attempt's drain ends). The exit of an attempt the
        worker does not run (not the job's current one, or placed on other workers) changes
        nothing else."""
        lease_id = session.running.pop((job_id, attempt), None)
        if lease_id is not None:  # the processes are gone: free (and account) their devices
            await self._ledger.release(lease_id)  # before anyone can see the job end
        else:  # stopped by the scheduler (cancelled, re-queued): its devices were held
            await self._drains.exited(session.worker_id, job_id, attempt)
        try:
            job = await self._jobs.get(job_id)
            # Only a worker running (a part of) the attempt may end it: any other (a stray
            # report, a credential of another worker) leaves the job as it is.
            current = job.attempt == attempt and holds_part(job, session.worker_id)
            if job.state not in ACTIVE_STATES or not current:
                log.info(
                    "exit_ignored",
                    job_id=job_id,
                    attempt=attempt,
                    state=state_name(job.state),
                    worker_id=session.worker_id,
                )
                return
            if job.worker_ids:  # a part of a multi-worker attempt
                if exit_code == 0 and session.worker_id != job.worker_id:
                    return  # finished its part: rank 0's exit decides the job
                why = f"its part on worker {session.worker_id} exited (code {exit_code})"
                await self.end_parts(job, why, except_worker=session.worker_id)
            await self._decide(job, session, exit_code, reason)
        finally:
            self._wake()

    async def _decide(
        self, job: common_pb2.Job, session: WorkerSession, exit_code: int, reason: str
    ) -> None:
        job_id, attempt = job.job_id, job.attempt
        report = await self._jobs.report(job_id, attempt)
        if exit_code == 0 and report.result is not None:
            await self._states.change(
                job_id,
                SUCCEEDED,
                report.session_end or finished_reason(job, report.result),
                expect_attempt=attempt,
                result=report.result,
            )
            return
        if ended_by_signal(exit_code):
            lost = reason or f"a process of the attempt was killed (exit code {exit_code})"
            await self.requeue(job_id, job.worker_id, lost)
            return
        if asks_for_retry(exit_code):
            lost = report.failure_reason or reason or "the trainer asked to retry later"
            await self.requeue(job_id, job.worker_id, lost)
            return
        why = report.failure_reason or reason or f"trainer exited with code {exit_code}"
        if exit_code == 0 and not (report.failure_reason or reason):
            why += " without reporting a result"
        await self._states.change(job_id, FAILED, why, expect_attempt=attempt)

    async def requeue(self, job_id: str, worker_id: str, why: str = "") -> None:
        """Put an active job whose attempt was lost (``why``; default: its worker was lost)
        back at the front of the queue, attempt kept; after ``max_attempts`` attempts, fail it
        with the reason of every attempt instead. A QUEUED job (its lease was taken by a
        placement that never committed) is put back in the queue if it is not there."""
        why = why or f"worker {worker_id} lost"
        async with self._placing:
            await self._requeue(job_id, worker_id, why)

    async def _requeue(self, job_id: str, worker_id: str, why: str) -> None:
        try:
            job = await self._jobs.get(job_id)
            if job.state == QUEUED:  # a lease of a placement cut short (the scheduler died
                await self._queue.ensure(job_id)  # mid-way): the job may be out of the queue
                return
            if job.state not in ACTIVE_STATES or not holds_part(job, worker_id):
                return
            if job.worker_ids:  # the attempt is one unit: end every part before re-queueing
                await self.end_parts(job, f"{why}; the whole attempt is re-queued", worker_id)
            await self._jobs.record_lost(job_id, job.attempt, why)
            if job.attempt >= self.max_attempts:
                history = await attempt_history(self._jobs, job_id, job.attempt)
                reason = f"gave up after {job.attempt} attempts: {history}"
                await self._states.change(job_id, FAILED, reason, expect_attempt=job.attempt)
                return
            reason = f"{why}; re-queued"
            await self._states.change(
                job_id, QUEUED, reason, worker_id="", expect_attempt=job.attempt, queue_front=True
            )
        except OpenTinkerError:  # gone, or moved on meanwhile: nothing to re-queue
            return

    async def end_parts(self, job: common_pb2.Job, reason: str, except_worker: str) -> None:
        """Stop the attempt's other parts and free their devices."""
        await end_parts(job, reason, except_worker, self._sessions, self._drains)
        self._wake()


def finished_reason(job: common_pb2.Job, result: scheduler_pb2.JobResult) -> str:
    """A succeeded job's reason: an inference job's episodes played and failed (it has no
    trainer to speak of); "trainer finished" for the others."""
    if job.spec.kind != common_pb2.JOB_KIND_INFERENCE:
        return "trainer finished"
    m = result.final_metrics
    played, failed = m.get("episodes", 0.0), m.get("env_errors", 0.0)
    return f"{played:.0f} episodes played, {failed:.0f} failed in the environment"
