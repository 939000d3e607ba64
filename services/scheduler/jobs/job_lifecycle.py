"""The life cycle of a job: its states, the moves between them, and the check every store
makes before it moves one.

QUEUED → ALLOCATING → RUNNING → SUCCEEDED | FAILED | CANCELLED, plus back to QUEUED when its
worker is lost; terminal states are final and every other move raises IllegalTransitionError.
Nothing here touches storage (job_store.py keeps the jobs).
"""

from __future__ import annotations

from typing import TypeAlias

from opentinker.common.v1 import common_pb2
from opentinker.services.scheduler.errors import IllegalTransitionError, StaleAttemptError

# The enum's int values (JOB_STATE_QUEUED, ...), typed as our generated .pyi stubs spell them
# (protoc's ``class JobState(int)``; ``.ValueType`` is mypy-protobuf's spelling, not ours).
JobState: TypeAlias = common_pb2.JobState

TERMINAL_STATES: frozenset[JobState] = frozenset(
    {common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED}
)
ACTIVE_STATES: frozenset[JobState] = frozenset(
    {common_pb2.JOB_STATE_ALLOCATING, common_pb2.JOB_STATE_RUNNING}
)

# Allowed moves; back to QUEUED happens when the worker is lost (the job resumes elsewhere).
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    # QUEUED -> FAILED: a job no worker can ever hold (unschedulable).
    common_pb2.JOB_STATE_QUEUED: frozenset(
        {
            common_pb2.JOB_STATE_ALLOCATING,
            common_pb2.JOB_STATE_CANCELLED,
            common_pb2.JOB_STATE_FAILED,
        }
    ),
    common_pb2.JOB_STATE_ALLOCATING: frozenset(
        {
            common_pb2.JOB_STATE_RUNNING,
            common_pb2.JOB_STATE_QUEUED,
            common_pb2.JOB_STATE_FAILED,
            common_pb2.JOB_STATE_CANCELLED,
        }
    ),
    common_pb2.JOB_STATE_RUNNING: frozenset(
        {
            common_pb2.JOB_STATE_SUCCEEDED,
            common_pb2.JOB_STATE_FAILED,
            common_pb2.JOB_STATE_CANCELLED,
            common_pb2.JOB_STATE_QUEUED,
        }
    ),
}


def state_name(state: JobState) -> str:
    """``JOB_STATE_RUNNING`` -> ``RUNNING``."""
    return common_pb2.JobState.Name(state).removeprefix("JOB_STATE_")


def check_transition(job: common_pb2.Job, to: JobState, expect_attempt: int | None) -> None:
    """StaleAttemptError when ``job`` is not at ``expect_attempt`` (None: any attempt);
    IllegalTransitionError when its state may not move to ``to``."""
    if expect_attempt is not None and job.attempt != expect_attempt:
        raise StaleAttemptError(
            f"job {job.job_id!r} is at attempt {job.attempt}, not {expect_attempt}",
            reason="STALE_ATTEMPT",
        )
    if to not in TRANSITIONS.get(job.state, frozenset()):
        final = " (terminal states are final)" if job.state in TERMINAL_STATES else ""
        raise IllegalTransitionError(
            f"job {job.job_id!r} is {state_name(job.state)} and cannot become "
            f"{state_name(to)}{final}",
            reason="ILLEGAL_TRANSITION",
        )
