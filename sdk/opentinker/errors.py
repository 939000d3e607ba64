"""The one exception tree of OpenTinker.

Every error inherits ``OpenTinkerError`` and the builtin it resembles, so callers can catch
either. Errors that come back from a gRPC call carry the status ``code`` (a ``grpc.StatusCode``
name) and the machine-readable ``reason`` the server attached.
"""

from __future__ import annotations


class OpenTinkerError(Exception):
    """Root of every OpenTinker error."""

    def __init__(self, message: str, *, code: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.reason = reason

    def __reduce__(self):  # picklable with its keyword fields
        return (_rebuild, (type(self), self.message, self.code, self.reason))


def _rebuild(cls: type[OpenTinkerError], message: str, code: str, reason: str) -> OpenTinkerError:
    return cls(message, code=code, reason=reason)


class ConfigError(OpenTinkerError, ValueError):
    """A setting or job spec is invalid; the message names the field and the fix."""


class InvalidArgumentError(OpenTinkerError, ValueError):
    """The server rejected a request's content (INVALID_ARGUMENT)."""


class NotFoundError(OpenTinkerError, LookupError):
    """The named job, environment or session does not exist (NOT_FOUND)."""


class AuthenticationError(OpenTinkerError, PermissionError):
    """Missing, wrong or revoked credentials (UNAUTHENTICATED)."""


class PermissionDeniedError(AuthenticationError):
    """The credential is good but may not make this call (PERMISSION_DENIED)."""


class AlreadyExistsError(OpenTinkerError, ValueError):
    """A tenant, user or other named resource with that id exists already (ALREADY_EXISTS)."""


class ResourceExhaustedError(OpenTinkerError, RuntimeError):
    """A quota or size limit was hit (RESOURCE_EXHAUSTED)."""


class UnavailableError(OpenTinkerError, ConnectionError):
    """A service or environment could not be reached (UNAVAILABLE / DEADLINE_EXCEEDED)."""


class FailedPreconditionError(OpenTinkerError, RuntimeError):
    """The request does not fit the resource's current state (FAILED_PRECONDITION)."""


class EnvironmentError_(OpenTinkerError, RuntimeError):
    """An environment replied badly or failed mid-episode."""


class JobFailedError(OpenTinkerError, RuntimeError):
    """A job ended FAILED or CANCELLED; ``reason`` says why."""


_BY_CODE: dict[str, type[OpenTinkerError]] = {
    "INVALID_ARGUMENT": InvalidArgumentError,
    "NOT_FOUND": NotFoundError,
    "UNAUTHENTICATED": AuthenticationError,
    "PERMISSION_DENIED": PermissionDeniedError,
    "ALREADY_EXISTS": AlreadyExistsError,
    "RESOURCE_EXHAUSTED": ResourceExhaustedError,
    "UNAVAILABLE": UnavailableError,
    "DEADLINE_EXCEEDED": UnavailableError,
    "FAILED_PRECONDITION": FailedPreconditionError,
}

# Trailing-metadata key under which servers put the machine-readable reason of an error.
REASON_METADATA_KEY = "opentinker-reason"
# The reason of a scheduler's UNAVAILABLE while its Redis has lost its state: workers and job
# processes wait for an operator (restore or re-bootstrap) instead of giving their jobs up.
STATE_LOST_REASON = "STATE_LOST"


def from_rpc_error(err) -> OpenTinkerError:
    """Turn a ``grpc.RpcError`` (sync or aio) into the matching typed error."""
    code = err.code().name if err.code() is not None else "UNKNOWN"
    reason = ""
    try:
        for key, value in err.trailing_metadata() or ():
            if key == REASON_METADATA_KEY:
                reason = value
    except Exception:  # some errors (e.g. channel closed) carry no metadata
        reason = ""
    cls = _BY_CODE.get(code, OpenTinkerError)
    return cls(f"{code}: {err.details()}", code=code, reason=reason)
