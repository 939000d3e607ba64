"""Tinker's per-training-client order: the SDK numbers a client's calls 1, 2, 3, ... (seq_id)
and may send call n+1 before call n has arrived (forward_backward chunks go in parallel).
A SeqGate lets each call through only when all calls before it have gone through."""

from __future__ import annotations

import asyncio

from opentinker.errors import FailedPreconditionError


class SeqGate:
    def __init__(self, *, first: int = 1, wait_s: float = 120.0) -> None:
        self.next = first
        self.wait_s = wait_s
        self._changed = asyncio.Condition()

    async def wait_turn(self, seq: int) -> None:
        """Return when ``seq`` is next; FailedPreconditionError for a seq already used, or
        when the calls before it have not come within ``wait_s``."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self.next >= seq), self.wait_s
                )
            except TimeoutError:
                raise FailedPreconditionError(
                    f"seq_id: call {seq} waited {self.wait_s:g} s for call {self.next}, "
                    "which never came"
                ) from None
            if self.next > seq:
                raise FailedPreconditionError(
                    f"seq_id: {seq} was already used (next is {self.next})"
                )

    async def advance(self) -> None:
        async with self._changed:
            self.next += 1
            self._changed.notify_all()
