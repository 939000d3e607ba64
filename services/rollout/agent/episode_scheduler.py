"""Asynchronous episodes: each one goes back to generation as soon as its env replied.

The lockstep loop generates for every episode, then steps every env, then generates again: one
slow env step holds the whole batch and the engine idles while envs work. Here every episode
is its own task (reset -> generate -> env step -> generate ... -> close) and one dispatcher
re-batches generation: at each engine call it takes the episodes that are ready then, so env
calls of some episodes are in flight while the engine generates for others.

When the engine is free the dispatcher starts a call at once if every live episode is waiting
for it; otherwise it waits for latecomers at most ``batch_wait_s`` (dynamic batching, as an
inference server's max queue delay): an engine call costs about the same for 1 episode as for
all of them on a small model, so a late episode that just misses a call costs a whole call.
By default the wait is half the mean engine call of this run (``WAIT_FRACTION``), so a slow
env step holds the others for at most half a call.

Rows of a call are in episode order, and call ``i`` samples with ``derive_seed(seed, "round",
i)``: when every env replies promptly, the calls and seeds are those of the lockstep loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from opentinker.services.rollout.agent.seeds import derive_seed

Ep = TypeVar("Ep")

# Wait for latecomers at most this fraction of the mean engine call so far ...
WAIT_FRACTION = 0.5
# ... and this long before the first call has been timed (seconds).
FIRST_WAIT_S = 0.5


@dataclass
class EpisodeSteps(Generic[Ep]):
    """What the scheduler does with an episode; the agent loop supplies each step.

    start: reset the env; the episode is then generating or already over.
    generate: one engine call for these episodes, sampled with this seed.
    interact: step the env with the episode's new turn (it may restart the episode).
    generating: whether the episode waits for a model turn (False = over).
    close: end its env session.
    """

    start: Callable[[Ep], Awaitable[None]]
    generate: Callable[[list[Ep], int], Awaitable[None]]
    interact: Callable[[Ep], Awaitable[None]]
    generating: Callable[[Ep], bool]
    close: Callable[[Ep], Awaitable[None]]


@dataclass
class _Waiting(Generic[Ep]):
    index: int  # the episode's position in the run: rows of a call are in this order
    episode: Ep
    done: asyncio.Future[None]


@dataclass
class SchedulerStats:
    """Engine calls of a run: how many, their seconds, and the episodes in each."""

    call_seconds: list[float] = field(default_factory=list)
    call_sizes: list[int] = field(default_factory=list)


class EpisodeScheduler(Generic[Ep]):
    """Plays episodes as independent tasks sharing one engine, re-batched at every call.

    batch_wait_s: the longest the engine waits for more ready episodes once one is ready;
    None = ``WAIT_FRACTION`` of the mean engine call of the run.
    """

    def __init__(self, steps: EpisodeSteps[Ep], *, seed: int, batch_wait_s: float | None = None):
        self.steps = steps
        self.seed = seed
        self.batch_wait_s = batch_wait_s
        self.stats = SchedulerStats()
        self._waiting: list[_Waiting[Ep]] = []
        self._live = 0
        self._changed = asyncio.Event()

    async def play(self, episodes: Sequence[Ep]) -> None:
        """Play every episode to its end; the first unexpected error cancels the rest."""
        self._live = len(episodes)
        tasks = [asyncio.create_task(self._episode(i, ep)) for i, ep in enumerate(episodes)]
        tasks.append(asyncio.create_task(self._dispatch()))
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _episode(self, index: int, ep: Ep) -> None:
        try:
            await self.steps.start(ep)
            while self.steps.generating(ep):
                await self._turn(index, ep)
                await self.steps.interact(ep)
        finally:
            self._live -= 1
            self._changed.set()
        await self.steps.close(ep)

    async def _turn(self, index: int, ep: Ep) -> None:
        """Wait for the engine call that generates this episode's next turn."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiting(index, ep, done))
        self._changed.set()
        await done

    async def _dispatch(self) -> None:
        """Engine calls, one at a time, each on the episodes ready when it starts."""
        while await self._batch_ready():
            batch = sorted(self._waiting, key=lambda w: w.index)
            self._waiting = []
            started = time.monotonic()
            seed = derive_seed(self.seed, "round", len(self.stats.call_seconds))
            try:
                await self.steps.generate([w.episode for w in batch], seed)
            except BaseException as err:
                for waiting in batch:
                    waiting.done.set_exception(err)
                raise
            self.stats.call_seconds.append(time.monotonic() - started)
            self.stats.call_sizes.append(len(batch))
            for waiting in batch:
                waiting.done.set_result(None)

    async def _batch_ready(self) -> bool:
        """Wait until an engine call should start (True) or no episode is left (False)."""
        deadline: float | None = None
        while self._live > 0:
            if self._waiting and len(self._waiting) >= self._live:
                return True  # nobody else could join
            timeout = None
            if self._waiting:
                deadline = deadline or time.monotonic() + self._wait_s()
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    return True
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout)
            except TimeoutError:
                return bool(self._waiting)
        return False

    def _wait_s(self) -> float:
        if self.batch_wait_s is not None:
            return self.batch_wait_s
        calls = self.stats.call_seconds
        return WAIT_FRACTION * sum(calls) / len(calls) if calls else FIRST_WAIT_S
