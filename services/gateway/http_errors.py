"""What both of the gateway's HTTP front doors (Tinker's ``/api/v1``, the OpenAI-compatible
``/v1``) do alike: read a body no further than a limit, and map our errors to HTTP status."""

from __future__ import annotations

from starlette.requests import Request

from opentinker.errors import (
    AuthenticationError,
    InvalidArgumentError,
    NotFoundError,
    OpenTinkerError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
)
from opentinker.services.gateway.futures import USER_ERRORS, FutureGoneError
from opentinker.services.gateway.sessions import SessionGoneError


class BodyTooLargeError(InvalidArgumentError):
    """A request body past max_body_bytes (HTTP 413)."""


# HTTP status of a call refused before it became a future (the SDK retries 429 and 5xx).
_STATUS = {
    SessionGoneError: 410,  # before NotFoundError: it is one
    FutureGoneError: 410,  # likewise
    BodyTooLargeError: 413,
    PermissionDeniedError: 403,  # before AuthenticationError: it is one
    AuthenticationError: 401,
    NotFoundError: 404,
    ResourceExhaustedError: 429,
    UnavailableError: 503,
}


def http_status(err: Exception) -> int:
    """The status of a refused call: a caller's mistake is 4xx, a failure of ours 500."""
    status = next((code for kind, code in _STATUS.items() if isinstance(err, kind)), 400)
    if isinstance(err, OpenTinkerError) and status == 400 and not isinstance(err, USER_ERRORS):
        status = 500
    return status


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, read no further than ``limit`` bytes (BodyTooLargeError past it:
    a client cannot make the gateway hold an unbounded body in memory)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():  # chunked, or a Content-Length that lied
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> BodyTooLargeError:
    return BodyTooLargeError(
        f"body: {size} bytes (or more) is over this gateway's max_body_bytes ({limit}); "
        "send smaller requests (fewer data per forward_backward)"
    )
