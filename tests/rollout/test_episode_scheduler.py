"""The asynchronous agent loop: episodes at their own pace, engine calls re-batched.

Real tiny model and in-process games; a slow env step is a real sleep.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest
from agent_loop_helpers import Countdown, GameSession, RecordingEngine

from opentinker.services.rollout.agent.agent_loop import AgentLoop
from opentinker.services.rollout.agent.loop_config import EpisodeRequest, LoopConfig
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.types import (
    Completion,
    FinishReason,
    StepOutcome,
    Trajectory,
)
from opentinker.spec import SamplingParams

pytestmark = pytest.mark.integration


class TimedSession(GameSession):
    """A game session whose steps take ``step_s`` seconds (a real sleep) and are timed."""

    def __init__(self, game: Countdown, step_s: float, log: list[tuple[str, float, float]]):
        super().__init__(game)
        self.step_s, self.log = step_s, log

    async def step(self, action: str) -> StepOutcome:
        started = time.monotonic()
        await asyncio.sleep(self.step_s)
        self.log.append(("env", started, time.monotonic()))
        return await super().step(action)


class TimedEngine(RecordingEngine):
    """The real engine, also logging when each generate call ran."""

    def __init__(self, engine: TransformersEngine, log: list[tuple[str, float, float]]) -> None:
        super().__init__(engine)
        self.log = log

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int
    ) -> list[Completion]:
        started = time.monotonic()
        out = super().generate(prompts, sampling, seed)
        self.log.append(("generate", started, time.monotonic()))
        return out


def play(
    engine: RecordingEngine,
    sessions: Sequence[GameSession],
    *,
    scheduling: str,
    max_turns: int = 3,
    batch_wait_s: float | None = None,
) -> list[Trajectory]:
    config = LoopConfig(
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4),
        max_turns=max_turns,
        max_episode_tokens=512,
        scheduling=scheduling,  # type: ignore[arg-type]
        batch_wait_s=batch_wait_s,
    )
    requests = [EpisodeRequest(f"ep-{n}", n, n, s) for n, s in enumerate(sessions)]
    trajectories, stats = asyncio.run(AgentLoop(engine, config).run(requests, seed=5))  # type: ignore[arg-type]
    assert stats.generated_tokens == sum(sum(t.loss_mask) for t in trajectories)
    assert all(s.closed for s in sessions)
    return trajectories


def test_a_fast_episode_does_not_wait_for_a_slow_env(base_engine: TransformersEngine) -> None:
    log: list[tuple[str, float, float]] = []
    engine = TimedEngine(base_engine, log)
    slow = TimedSession(Countdown(turns=3), step_s=0.6, log=log)
    fast = TimedSession(Countdown(turns=3), step_s=0.0, log=log)
    slow_t, fast_t = play(engine, [slow, fast], scheduling="async", batch_wait_s=0.02)
    assert slow_t.finish_reason is fast_t.finish_reason is FinishReason.ENV_DONE
    assert slow_t.num_turns == fast_t.num_turns == 3
    # Both start together; the fast episode then plays its other two turns alone while the
    # slow env sleeps, and the slow one's last two turns are alone too: 2 + 1 + 1 + 1 + 1.
    assert engine.calls[0] == 2 and sorted(engine.calls) == [1, 1, 1, 1, 2]
    # Env calls overlap generation: a generate call ran inside the slow env's first step.
    _, slow_start, slow_end = next(e for e in log if e[0] == "env" and e[2] - e[1] > 0.5)
    during = [e for e in log if e[0] == "generate" and slow_start < e[1] < slow_end]
    assert len(during) == 2  # the fast episode's turns 2 and 3


def test_lockstep_waits_for_the_slow_env(base_engine: TransformersEngine) -> None:
    log: list[tuple[str, float, float]] = []
    engine = TimedEngine(base_engine, log)
    sessions = [
        TimedSession(Countdown(turns=3), step_s=0.3, log=log),
        TimedSession(Countdown(turns=3), step_s=0.0, log=log),
    ]
    play(engine, sessions, scheduling="lockstep")
    assert engine.calls == [2, 2, 2]  # every round waits for both envs


def test_async_and_lockstep_agree_when_envs_reply_at_once(
    base_engine: TransformersEngine,
) -> None:
    """Prompt envs: the same engine calls with the same seeds, so the same trajectories."""
    played = {}
    for scheduling in ("async", "lockstep"):
        engine = RecordingEngine(base_engine)
        sessions = [GameSession(Countdown(turns=turns)) for turns in (1, 3, 2)]
        played[scheduling] = (play(engine, sessions, scheduling=scheduling), engine.calls)
    (async_t, async_calls), (lockstep_t, lockstep_calls) = played["async"], played["lockstep"]
    assert async_calls == lockstep_calls == [3, 2, 1]
    assert [t.token_ids for t in async_t] == [t.token_ids for t in lockstep_t]
    assert [t.logprobs for t in async_t] == [t.logprobs for t in lockstep_t]


class BrokenEngine(RecordingEngine):
    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int
    ) -> list[Completion]:
        if self.calls:
            raise RuntimeError("the GPU caught fire")
        return super().generate(prompts, sampling, seed)


def test_an_engine_failure_ends_the_run_with_its_error(
    base_engine: TransformersEngine,
) -> None:
    sessions = [GameSession(Countdown(turns=3)) for _ in range(3)]
    with pytest.raises(RuntimeError, match="caught fire"):
        play(BrokenEngine(base_engine), sessions, scheduling="async")
