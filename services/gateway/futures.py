"""The gateway's only state: futures of requests in flight, until their results are read.

Every Tinker call that does work answers at once with a ``request_id``; the SDK then polls
``/api/v1/retrieve_future``. A poll waits up to ``long_poll_s`` for the result and otherwise
answers ``try_again``. A failed request's result is ``{"error", "category"}`` with category
``user`` (the request was wrong: bad input, unsupported loss, out-of-order state) or
``server``. Results are kept ``keep_s`` after they are ready (a poll may be retried).

Futures live in this process only: a request id names the gateway instance that made it, so a
poll after a restart is told its request was lost (HTTP 410: send it again) rather than that
it never existed (404).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass

import structlog

from opentinker.errors import (
    AlreadyExistsError,
    AuthenticationError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
)

log = structlog.get_logger("gateway.futures")
USER_ERRORS = (
    AuthenticationError,  # a missing, unknown or revoked key: the caller's to fix
    InvalidArgumentError,
    FailedPreconditionError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    AlreadyExistsError,
)


@dataclass(frozen=True)
class Result:
    """A finished request: JSON (``body`` a dict) or protobuf (``body`` bytes)."""

    body: dict | bytes


@dataclass
class _Entry:
    task: asyncio.Future[Result]
    tenant: str
    done_at: float | None = None


_REQUEST_ID = re.compile(r"req-([0-9a-f]{12})-[0-9a-f]{32}")  # req-<instance>-<uuid>


class FutureGoneError(NotFoundError):
    """A request of an earlier gateway instance: lost with it (HTTP 410)."""


class FutureStore:
    def __init__(self, *, long_poll_s: float = 20.0, keep_s: float = 600.0) -> None:
        self.long_poll_s = long_poll_s
        self.keep_s = keep_s
        self._entries: dict[str, _Entry] = {}
        self.instance = uuid.uuid4().hex[:12]  # in every request id this store makes

    def start(self, work: Awaitable[Result], *, tenant: str) -> str:
        """Run ``work`` in the background; the id the caller polls its result with."""
        self._prune()
        request_id = f"req-{self.instance}-{uuid.uuid4().hex}"
        entry = _Entry(task=asyncio.ensure_future(work), tenant=tenant)
        entry.task.add_done_callback(lambda _: setattr(entry, "done_at", time.monotonic()))
        self._entries[request_id] = entry
        return request_id

    async def retrieve(self, request_id: str, *, tenant: str) -> Result | None:
        """The result (or its error as a Result), or None while it is still running.
        NotFoundError for an unknown id or another tenant's."""
        entry = self._entries.get(request_id)
        if entry is None or entry.tenant != tenant:
            raise self._unknown(request_id)
        done, _ = await asyncio.wait({entry.task}, timeout=self.long_poll_s)
        if not done:
            return None
        err = entry.task.exception()
        if err is None:
            return entry.task.result()
        return Result(error_body(err))

    def _unknown(self, request_id: str) -> NotFoundError:
        made = _REQUEST_ID.fullmatch(request_id)
        if made is not None and made.group(1) != self.instance:
            return FutureGoneError(
                f"request_id: {request_id!r} was made by an earlier gateway instance, which "
                f"restarted since; its work and result were lost with it: send the request again"
            )
        return NotFoundError(
            f"request_id: no request {request_id!r} of yours (a result is kept "
            f"{self.keep_s:g} s after it is ready)"
        )

    def _prune(self) -> None:
        horizon = time.monotonic() - self.keep_s
        for request_id in [
            k for k, e in self._entries.items() if e.done_at is not None and e.done_at < horizon
        ]:
            del self._entries[request_id]


def error_body(err: BaseException) -> dict:
    """Tinker's per-request failure: the message and whether the caller or we are to blame."""
    category = "user" if isinstance(err, (*USER_ERRORS, ValueError)) else "server"
    if category == "server":
        log.warning("request_failed", error=repr(err))
    return {"error": str(err) or type(err).__name__, "category": category}
