"""How a job's attempts end: an infrastructure fault (re-queue it) or the job's own failure, and
the history of why each attempt ended, for the reason of a job that gave up."""

from __future__ import annotations

from opentinker.services.common.exit_codes import RETRY_LATER
from opentinker.services.scheduler.jobs.job_store import JobStore


def ended_by_signal(exit_code: int) -> bool:
    """True when a JobExited code says a process of the attempt was killed rather than the
    trainer ending by itself: negative is asyncio's -N for signal N (or -1, the worker could not
    run or watch it), 129..192 is 128 + N as shells and the trainer's SIGTERM handler report."""
    return exit_code < 0 or 128 < exit_code <= 128 + 64


def asks_for_retry(exit_code: int) -> bool:
    """True when the trainer ended its attempt to be re-queued (exit_codes.RETRY_LATER: a
    fault of the node's storage, with the operator's on_storage_error=requeue)."""
    return exit_code == RETRY_LATER


async def attempt_history(jobs: JobStore, job_id: str, attempts: int) -> str:
    """``1: why attempt 1 ended; 2: ...`` from what each attempt's report kept."""
    why = []
    for n in range(1, attempts + 1):
        report = await jobs.report(job_id, n)
        why.append(f"{n}: {report.lost_reason or report.failure_reason or 'no reason kept'}")
    return "; ".join(why)
