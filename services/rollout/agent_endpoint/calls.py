"""The engine calls of agent-program episodes: each HTTP call's prompt waits a moment for the
calls of the other episodes, then all go to the engine as one batched ``generate`` (as the
agent loop batches its GENERATING episodes), with the job's sampling and a seed derived per
engine call."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from opentinker.services.rollout.agent.loop_config import LoopConfig
from opentinker.services.rollout.agent.seeds import derive_seed
from opentinker.services.rollout.engines.engine import GenerationEngine
from opentinker.services.rollout.types import Completion, RolloutStats

DEFAULT_WAIT_S = 0.005  # the least a call waits for company when batch_wait_s is unset
# The first call of a run waits (at most this long) for every other program's first call:
# programs start together (a thread or a process each, an openai client each), and on a busy
# machine 0.5 s was too short for 16 of them, so the first turn took two engine calls
# (bench/agent_endpoint.py: 5 engine calls for 4 turns, 0.45x of Reset/Step).
FIRST_WAIT_S = 5.0


@dataclass
class _Call:
    prompt: list[int]
    limit: int  # new tokens this call may take
    done: asyncio.Future[Completion] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class GenerationQueue:
    """Batches the calls of one run; ``generate`` is awaited by each episode's call."""

    def __init__(
        self,
        engine: GenerationEngine,
        config: LoopConfig,
        *,
        seed: int,
        stats: RolloutStats,
        waiting_for: Callable[[], int],
    ) -> None:
        """waiting_for: how many calls could come at most now (the episodes still playing):
        once that many wait, the batch goes without waiting out the window."""
        self.engine = engine
        self.config = config
        self.seed = seed
        self.stats = stats
        self.waiting_for = waiting_for
        self.engine_calls = 0
        self._pending: list[_Call] = []
        self._arrived = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None

    async def generate(self, prompt: list[int], limit: int) -> Completion:
        call = _Call(prompt, limit)
        self._pending.append(call)
        self._arrived.set()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._serve())
        return await call.done

    def episode_ended(self) -> None:
        """An episode ended (``waiting_for`` dropped): the calls waiting may be all there
        will be, so the batch need not wait out its window."""
        self._arrived.set()

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with_cancel = asyncio.gather(self._worker, return_exceptions=True)
            await with_cancel

    async def _serve(self) -> None:
        while self._pending:
            wait_s = self._wait_s()
            deadline = time.monotonic() + wait_s
            while len(self._pending) < self.waiting_for() and time.monotonic() < deadline:
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), deadline - time.monotonic())
                except TimeoutError:
                    break
            batch, self._pending = self._pending, []
            await self._run(batch)

    def _wait_s(self) -> float:
        """How long a call waits for the others: batch_wait_s, else half the mean engine call
        so far (as the agent loop's scheduler waits): an agent program's next call comes
        after an HTTP round trip, its client and its own code, later than a loop's turn."""
        if self.config.batch_wait_s is not None:
            return self.config.batch_wait_s
        if not self.engine_calls:  # the programs are starting (threads, clients): wait more
            return FIRST_WAIT_S
        return max(DEFAULT_WAIT_S, 0.5 * self.stats.generate_seconds / self.engine_calls)

    async def _run(self, batch: list[_Call]) -> None:
        sampling = self.config.sampling.model_copy(
            update={"max_new_tokens": max(c.limit for c in batch)}
        )
        seed = derive_seed(self.seed, "agent-call", self.engine_calls)
        self.engine_calls += 1
        prompts = [c.prompt for c in batch]
        if self.config.greedy:
            call = functools.partial(self.engine.generate, prompts, sampling, seed, greedy=True)
        else:
            call = functools.partial(self.engine.generate, prompts, sampling, seed)
        started = time.monotonic()
        try:
            completions: list[Completion] = await asyncio.to_thread(call)
        except Exception as err:  # noqa: BLE001 - the engine's failure goes to every caller
            for c in batch:
                c.done.set_exception(err)
            return
        finally:
            self.stats.generate_seconds += time.monotonic() - started
        for c, completion in zip(batch, completions, strict=True):
            cut = Completion(completion.token_ids[: c.limit], completion.logprobs[: c.limit])
            self.stats.generated_tokens += len(cut.token_ids)
            c.done.set_result(cut)
