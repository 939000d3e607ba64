"""Long-lived streams whose caller's credential is checked again while they last.

A credential is checked when a call starts; a `WatchJob` stream is one call that can last as
long as its job. Revoking the key must end it too, not only the calls made after: the events
are passed on while the credential holds, and it is checked again every ``every_s`` seconds
(also while no event comes).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import structlog
from redis.exceptions import RedisError

from opentinker.errors import AuthenticationError

T = TypeVar("T")
log = structlog.get_logger("opentinker.scheduler")


async def while_not_revoked(
    items: AsyncIterator[T], revoked: Callable[[], Awaitable[bool]], *, every_s: float
) -> AsyncIterator[T]:
    """``items`` until they end, or AuthenticationError once ``revoked()`` says so."""
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(items))
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                if await _revoked(revoked):
                    raise AuthenticationError(
                        "the API key this stream was opened with was revoked; "
                        "sign in with a valid key"
                    )
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield item
    finally:
        if pending is not None:
            pending.cancel()


async def _revoked(revoked: Callable[[], Awaitable[bool]]) -> bool:
    """``revoked()``, False when it cannot answer (Redis briefly away): an outage of the
    identity store does not end a stream that was admitted; the next check decides."""
    try:
        return await revoked()
    except (OSError, RedisError) as err:
        log.warning("credential_recheck_failed", error=repr(err))
        return False
