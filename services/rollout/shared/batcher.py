"""Merge concurrent jobs' generate calls into one mixed-adapter engine call.

Each job's agent loop calls its ``AdapterEngine.generate`` from its own thread. Those calls
meet here: a call that finds the engine idle waits for company, at most ``window_s`` and only
while fewer calls wait than there are jobs on the engine (``company()``: a lone job never
waits), then runs every call waiting by then as one ``generate_rows`` call and hands each
caller its own rows back; calls that arrive while the engine is busy wait and go together in
the next call. A failing engine call fails every call in it with the same error.

An adapter leaves (``retire``: its job's stream ended, perhaps while its call still waited
here) before the engine drops it: its waiting calls fail alone and later ones are refused, so
no engine call mixes rows of an adapter the engine no longer holds with other jobs' rows
(the engine would fail the whole call, the other jobs' rows with it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from opentinker.errors import FailedPreconditionError
from opentinker.services.rollout.engines.multi_lora import LoraRow, MixedLoraEngine
from opentinker.services.rollout.types import Completion

DEFAULT_WINDOW_S = 0.005


@dataclass
class _Call:
    rows: Sequence[LoraRow]
    done: threading.Event = field(default_factory=threading.Event)
    result: list[Completion] | None = None
    error: BaseException | None = None


@dataclass
class BatcherStats:
    """Engine calls made: how many rows each, and how many jobs' calls each merged."""

    rows: list[int] = field(default_factory=list)
    calls_merged: list[int] = field(default_factory=list)


class MixedBatcher:
    """Thread-safe; ``submit`` blocks its caller until its rows are generated."""

    def __init__(
        self,
        engine: MixedLoraEngine,
        *,
        window_s: float = DEFAULT_WINDOW_S,
        company: Callable[[], int] = lambda: 2**31,
    ) -> None:
        """company: how many calls could come at most (the jobs on the engine); the default
        always waits the whole window."""
        self.engine = engine
        self.window_s = window_s
        self.company = company
        self.stats = BatcherStats()
        self._cond = threading.Condition()
        self._pending: list[_Call] = []
        self._busy = False
        self._running: set[str] = set()  # the adapters of the engine call in progress
        self._retired: set[str] = set()  # adapters that left: their calls are refused

    def admit(self, adapter: str) -> None:
        """Serve ``adapter``'s calls (again: a job attached anew under a retired name)."""
        with self._cond:
            self._retired.discard(adapter)

    def retire(self, adapter: str) -> None:
        """Stop serving ``adapter`` before the engine drops it: its waiting calls fail, later
        ones are refused, and this returns once no engine call in progress holds its rows."""
        with self._cond:
            self._retired.add(adapter)
            leaving = [call for call in self._pending if _names(call, adapter)]
            self._pending = [call for call in self._pending if not _names(call, adapter)]
            for call in leaving:
                call.error = _left(adapter)
                call.done.set()
            self._cond.notify_all()
            self._cond.wait_for(lambda: adapter not in self._running)

    def submit(self, rows: Sequence[LoraRow]) -> list[Completion]:
        call = _Call(rows)
        with self._cond:
            if gone := next((row.adapter for row in rows if row.adapter in self._retired), None):
                raise _left(gone)
            self._pending.append(call)
            self._cond.notify_all()
        while not call.done.is_set():
            with self._cond:
                if self._busy or call.done.is_set():
                    self._cond.wait_for(lambda: not self._busy or call.done.is_set())
                    continue
                self._busy = True
            try:
                self._lead()
            finally:
                with self._cond:
                    self._busy = False
                    self._running = set()
                    self._cond.notify_all()
        if call.error is not None:
            raise call.error
        assert call.result is not None
        return call.result

    def _lead(self) -> None:
        """Run one engine call for every call pending (after waiting for company, if any)."""
        deadline = time.monotonic() + self.window_s
        with self._cond:
            while len(self._pending) < self.company():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            calls, self._pending = self._pending, []
            self._running = {row.adapter for call in calls for row in call.rows}
        if not calls:
            return
        rows = [row for call in calls for row in call.rows]
        try:
            completions = self.engine.generate_rows(rows)
        except BaseException as err:  # every caller of this engine call gets the error
            for call in calls:
                call.error = err
                call.done.set()
            return
        self.stats.rows.append(len(rows))
        self.stats.calls_merged.append(len(calls))
        start = 0
        for call in calls:
            call.result = completions[start : start + len(call.rows)]
            start += len(call.rows)
            call.done.set()


def _names(call: _Call, adapter: str) -> bool:
    return any(row.adapter == adapter for row in call.rows)


def _left(adapter: str) -> FailedPreconditionError:
    return FailedPreconditionError(
        f"adapter {adapter!r} left this shared engine (its job's Rollout stream ended); "
        "its generate call was dropped",
        code="FAILED_PRECONDITION",
    )
