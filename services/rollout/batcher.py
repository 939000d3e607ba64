"""Merge concurrent jobs' generate calls into one mixed-adapter engine call.

Each job's agent loop calls its ``AdapterEngine.generate`` from its own thread. Those calls
meet here: a call that finds the engine idle waits for company, at most ``window_s`` and only
while fewer calls wait than there are jobs on the engine (``company()``: a lone job never
waits), then runs every call waiting by then as one ``generate_rows`` call and hands each
caller its own rows back; calls that arrive while the engine is busy wait and go together in
the next call. A failing engine call fails every call in it with the same error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .multi_lora import LoraRow, MixedLoraEngine
from .types import Completion

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

    def submit(self, rows: Sequence[LoraRow]) -> list[Completion]:
        call = _Call(rows)
        with self._cond:
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
