"""Domain errors of the scheduler; the servicer maps each to a gRPC status code."""

from __future__ import annotations

from opentinker.errors import FailedPreconditionError, NotFoundError


class JobNotFoundError(NotFoundError):
    """No job has this id (NOT_FOUND)."""

    @classmethod
    def for_id(cls, job_id: str) -> JobNotFoundError:
        return cls(f"job {job_id!r} not found", reason="JOB_NOT_FOUND")


class IllegalTransitionError(FailedPreconditionError):
    """A state change the job life cycle does not allow, e.g. out of a terminal state."""


class StaleAttemptError(FailedPreconditionError):
    """A message about an attempt of a job that is no longer its current attempt."""


class IdentityNotFoundError(NotFoundError):
    """No tenant, user or key has this id (NOT_FOUND)."""
