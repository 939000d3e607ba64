"""Waiting on an asyncio.Event with a timeout, in a way that never swallows a cancellation."""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``event``; True if it is set.

    Not ``asyncio.wait_for``: before Python 3.12 it can swallow a cancellation that arrives as
    the wait ends, and a loop built on it then never stops.
    """
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout_s)
    finally:
        waiter.cancel()
    return event.is_set()
