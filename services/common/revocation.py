"""Long-lived calls whose caller's credential is checked again while they last.

A credential is checked when a call starts; a stream (the scheduler's `WatchJob`, EnvHub's
`RunEpisodes`) is one call that can last as long as its job. Revoking the key must end it too,
not only the calls made after. So the credential is checked again every ``every_s`` seconds, on
a clock of its own: whether items flow fast, slowly or not at all, a revoked credential ends the
call (AuthenticationError) at most ``every_s`` plus one check's time after the revocation.

``revoked()`` answers True once the credential no longer holds (revoked, deleted with its user,
or a job token of an attempt that ended). When it cannot answer (the identity store briefly
away: OSError, RedisError, UnavailableError) the call goes on: an outage does not end a call
that was admitted; the next check decides.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, NoReturn, TypeVar

import structlog
from redis.exceptions import RedisError

from opentinker.errors import AuthenticationError, UnavailableError

T = TypeVar("T")
Revoked = Callable[[], Awaitable[bool]]
log = structlog.get_logger("opentinker.revocation")

REVOKED_MESSAGE = (
    "the credential this stream was opened with was revoked (or its job attempt ended); "
    "sign in with a valid key"
)


async def while_not_revoked(
    items: AsyncIterator[T], revoked: Revoked, *, every_s: float
) -> AsyncIterator[T]:
    """``items`` until they end, or AuthenticationError once ``revoked()`` says so."""
    watch = asyncio.ensure_future(_raise_when_revoked(revoked, every_s))
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            pending = asyncio.ensure_future(anext(items))
            await asyncio.wait({pending, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not pending.done():
                watch.result()  # the watch ended first: it raises AuthenticationError
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield item
    finally:
        await _stop(pending, watch)


async def until_revoked(work: Coroutine[Any, Any, T], revoked: Revoked, *, every_s: float) -> T:
    """``work``'s result, or AuthenticationError once ``revoked()`` says so (``work`` is then
    cancelled, and has finished its clean-up, before the error is raised)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_raise_when_revoked(revoked, every_s))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            watch.result()  # raises AuthenticationError
        return task.result()
    finally:
        await _stop(task, watch)


async def _raise_when_revoked(revoked: Revoked, every_s: float) -> NoReturn:
    while True:
        await asyncio.sleep(every_s)
        if await _revoked(revoked):
            raise AuthenticationError(REVOKED_MESSAGE, reason="CREDENTIAL_REVOKED")


async def _revoked(revoked: Revoked) -> bool:
    """``revoked()``, False when it cannot answer (see the module docstring)."""
    try:
        return await revoked()
    except (OSError, RedisError, UnavailableError) as err:
        log.warning("credential_recheck_failed", error=repr(err))
        return False


async def _stop(*futures: asyncio.Future[Any] | None) -> None:
    """Cancel what still runs and wait until it has finished (its ``finally`` run); what ended
    with an error already was raised or is not wanted, so it is only marked as seen."""
    running = [f for f in futures if f is not None and not f.done()]
    for future in running:
        future.cancel()
    if running:
        await asyncio.wait(running)
    for ended in futures:
        if ended is not None and ended.done() and not ended.cancelled():
            ended.exception()  # seen: no "exception was never retrieved" at collection
