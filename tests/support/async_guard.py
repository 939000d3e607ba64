"""Run an async test with a deadline; when it is stuck, show where it waits (tests only)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable


def run(coro_fn: Callable[[], Awaitable[None]], timeout_s: float = 45) -> None:
    """Run the test's coroutine; past ``timeout_s`` print its await chain and fail."""

    async def guarded() -> None:
        test = asyncio.ensure_future(coro_fn())
        done, _ = await asyncio.wait({test}, timeout=timeout_s)
        if not done:
            print_await_chain(test.get_coro())
            test.cancel()
            raise AssertionError(f"test did not finish within {timeout_s} s (stacks on stderr)")
        test.result()

    asyncio.run(guarded())


def print_await_chain(coro: object) -> None:
    """Where a stuck coroutine waits: each frame along its chain of awaits, on stderr."""
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            print(f"  awaiting in {frame.f_code.co_filename}:{frame.f_lineno}", file=sys.stderr)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
