"""Fair turns on one shared model: many sessions' model work, one unit at a time, round-robin.

Each session queues its units (a forward_backward, an optim_step, ...) in its own FIFO; one
dispatcher runs them in a worker thread, taking the next session in a fixed cycle that has
work waiting. A session with many queued units therefore never starves one with a single
unit: with k sessions busy, each waits for at most k - 1 other units before its next runs.
Each session's own units keep their order (a session's calls are already ordered by
``CallOrder``). Busy seconds and units are counted per session for accounting.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

log = structlog.get_logger(__name__)
T = TypeVar("T")
# Runs one unit of ``key``'s work in the calling (worker) thread: activates its adapter, ...
RunUnit = Callable[[str, Callable[[], Any]], Any]


@dataclass
class TurnUsage:
    """What a session's turns took: ``units`` run, ``busy_s`` seconds of model work."""

    units: int = 0
    busy_s: float = 0.0


class FairTurns:
    """Round-robin turns across sessions (see the module docstring); asyncio-side API."""

    def __init__(self, run_unit: RunUnit) -> None:
        self._run_unit = run_unit
        self._queues: dict[str, deque[tuple[Callable[[], Any], asyncio.Future]]] = {}
        self._cycle: list[str] = []  # sessions in the order they first queued work
        self._next = 0
        self._dispatcher: asyncio.Task | None = None
        self.usage: dict[str, TurnUsage] = {}

    async def run(self, key: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` as one unit of ``key``'s work, in its turn; its result or exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        if key not in self._queues:
            self._queues[key] = deque()
            self._cycle.append(key)
            self.usage.setdefault(key, TurnUsage())
        self._queues[key].append((fn, future))
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = asyncio.create_task(self._dispatch())
        return await future

    def waiting(self, key: str) -> int:
        """Units queued by other sessions that run before ``key``'s next one, at most."""
        return sum(1 for other, q in self._queues.items() if other != key and q)

    def forget(self, key: str) -> None:
        """Drop ``key`` from the cycle (its session ended); its usage stays readable."""
        queue = self._queues.pop(key, None)
        if key in self._cycle:
            at = self._cycle.index(key)
            self._cycle.pop(at)
            if at < self._next:
                self._next -= 1
        for _, future in queue or ():
            if not future.done():
                future.set_exception(RuntimeError(f"session {key} left the shared host"))

    def _pick(self) -> tuple[str, Callable[[], Any], asyncio.Future] | None:
        for i in range(len(self._cycle)):
            at = (self._next + i) % len(self._cycle)
            key = self._cycle[at]
            queue = self._queues[key]
            while queue:
                fn, future = queue.popleft()
                if future.done():  # its caller gave up before its turn
                    continue
                self._next = (at + 1) % len(self._cycle)
                return key, fn, future
        return None

    async def _dispatch(self) -> None:
        while True:
            picked = self._pick()
            if picked is None:  # no await since: a run() now starts a new dispatcher
                return
            key, fn, future = picked
            started = time.perf_counter()
            try:
                result = await asyncio.to_thread(self._run_unit, key, fn)
            except BaseException as err:  # the unit's own failure goes to its caller
                if not future.done():
                    future.set_exception(err)
                if isinstance(err, asyncio.CancelledError):
                    raise
            else:
                if not future.done():
                    future.set_result(result)
            finally:
                usage = self.usage.setdefault(key, TurnUsage())
                usage.units += 1
                usage.busy_s += time.perf_counter() - started
