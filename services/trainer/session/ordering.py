"""Calls of a session applied in the client's order (its ``seq``: 1, 2, 3, ...).

A call may arrive before its predecessor (a client firing futures back to back over several
connections): it waits for its turn, up to ``wait_s``. A seq already applied, or claimed by a
call in flight, is out of order. A call that fails still uses up its seq: it was answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from opentinker.errors import FailedPreconditionError


class CallOrder:
    def __init__(self, *, wait_s: float) -> None:
        self.last_seq = 0
        self._wait_s = wait_s
        self._claimed: set[int] = set()
        self._changed = asyncio.Condition()

    @asynccontextmanager
    async def turn(self, seq: int) -> AsyncIterator[None]:
        """Run the body as call ``seq``, once every earlier call has run."""
        if seq <= self.last_seq or seq in self._claimed:
            raise FailedPreconditionError(
                f"call seq {seq} is out of order: seq {self.last_seq} was the last applied; "
                f"number calls 1, 2, 3, ... and send each once",
                reason="OUT_OF_ORDER",
            )
        self._claimed.add(seq)
        try:
            async with self._changed:
                try:
                    await asyncio.wait_for(
                        self._changed.wait_for(lambda: self.last_seq == seq - 1), self._wait_s
                    )
                except TimeoutError:
                    raise FailedPreconditionError(
                        f"call seq {seq} waited {self._wait_s:g} s for seq {self.last_seq + 1}, "
                        "which never came; resend the missing call",
                        reason="OUT_OF_ORDER",
                    ) from None
            try:
                yield
            finally:
                async with self._changed:
                    self.last_seq = seq
                    self._changed.notify_all()
        finally:
            self._claimed.discard(seq)
