"""Agent-program episodes restart as the agent loop's do: an env instance that died at Reset
(UNAVAILABLE), lost the episode at its grading Step (NOT_FOUND) or a lost link to the envs
starts the episode over from Reset on a fresh session, program and all, up to
max_episode_retries (a lost link without using them); the program's own failure is final."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import openai
import pytest
from agent_loop_helpers import Countdown, GameSession, RecordingEngine

from opentinker.errors import EnvironmentError_
from opentinker.services.rollout.agent.agent_loop import AgentLoop
from opentinker.services.rollout.agent.env_replies import EnvLinkLostError
from opentinker.services.rollout.agent.loop_config import EpisodeRequest, LoopConfig
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.types import FinishReason, ResetResult, StepOutcome, Trajectory
from opentinker.spec import SamplingParams
from opentinker.spec_agent import AgentProgram

pytestmark = pytest.mark.integration
PROGRAM_RUNS: list[str] = []


def one_call_agent(*, base_url: str, api_key: str, task: str, seed: int) -> None:
    """One call; the env grades the answer (None). Fails when the task says so."""
    PROGRAM_RUNS.append(base_url)
    if "Start" not in task:
        raise RuntimeError("not a countdown task")
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task}])


class FailingSession(GameSession):
    """Fails its Reset (``at="reset"``) or its Step with ``error``."""

    def __init__(self, error: Exception, at: str) -> None:
        super().__init__(Countdown(turns=1))
        self.error, self.at = error, at

    async def reset(self, seed: int, options: Mapping[str, str]) -> ResetResult:
        if self.at == "reset":
            raise self.error
        return await super().reset(seed, options)

    async def step(self, action: str) -> StepOutcome:
        if self.at == "step":
            raise self.error
        return await super().step(action)


class NotATask(GameSession):
    async def reset(self, seed: int, options: Mapping[str, str]) -> ResetResult:
        return ResetResult("", "no task here")


def _play(
    base_engine: TransformersEngine, first: GameSession, then: type | GameSession
) -> tuple[Trajectory, int, list[GameSession]]:
    """Play one episode starting on ``first``; ``reopen`` gives ``then`` (a session, or a
    factory of fresh ones). The trajectory, the batch's env_retries, the sessions opened."""
    PROGRAM_RUNS.clear()
    opened: list[GameSession] = []

    def reopen(env_episode_id: str) -> GameSession:
        assert env_episode_id == f"ep-0-r{len(opened) + 1}"
        opened.append(then() if callable(then) else then)
        return opened[-1]

    config = LoopConfig(
        sampling=SamplingParams(temperature=1.0, max_new_tokens=4),
        max_turns=2,
        max_episode_tokens=256,
        max_episode_retries=1,
        agent=AgentProgram(callable="test_agent_endpoint_restart:one_call_agent"),
    )

    async def run() -> tuple[list[Trajectory], int]:
        loop = AgentLoop(RecordingEngine(base_engine), config)  # type: ignore[arg-type]
        assert loop.agent_programs is not None
        try:
            trajectories, stats = await loop.run(
                [EpisodeRequest("ep-0", 0, 3, first, reopen)], seed=1
            )
        finally:
            await loop.agent_programs.close()
        return trajectories, stats.env_retries

    [t], retries = asyncio.run(run())
    assert first.closed and all(s.closed for s in opened)
    return t, retries, opened


def test_a_dead_instance_at_reset_restarts_the_episode(base_engine: TransformersEngine) -> None:
    died = EnvironmentError_("instance 10.0.0.1:7 went away", code="UNAVAILABLE")
    t, retries, opened = _play(
        base_engine, FailingSession(died, "reset"), lambda: GameSession(Countdown(turns=1))
    )
    assert (t.finish_reason, t.env_retries, retries, len(opened)) == (
        FinishReason.ENV_DONE,
        1,
        1,
        1,
    )
    assert t.reward == 0.25 and len(opened[0].actions) == 1 and sum(t.loss_mask) > 0
    assert len(PROGRAM_RUNS) == 1  # the program never started on the dead instance


def test_a_lost_episode_at_grading_gives_up_after_the_retries(
    base_engine: TransformersEngine,
) -> None:
    def lost() -> GameSession:
        return FailingSession(EnvironmentError_("no episode ep-0", code="NOT_FOUND"), "step")

    t, retries, opened = _play(base_engine, lost(), lost)
    assert (t.finish_reason, t.env_retries, retries, len(opened)) == (
        FinishReason.ENV_ERROR,
        1,
        1,
        1,
    )
    assert "no episode ep-0" in t.finish_detail
    assert "gave up after 1 restarts; max_episode_retries=1" in t.finish_detail
    assert len(PROGRAM_RUNS) == 2  # the program played each attempt


def test_a_lost_link_restarts_without_using_the_retries(base_engine: TransformersEngine) -> None:
    link = EnvLinkLostError("the EnvHub stream broke", code="UNAVAILABLE")
    t, retries, opened = _play(
        base_engine, FailingSession(link, "reset"), lambda: GameSession(Countdown(turns=1))
    )
    assert (t.finish_reason, t.env_retries, retries, len(opened)) == (
        FinishReason.ENV_DONE,
        0,
        0,
        1,
    )


def test_the_programs_own_failure_is_not_restarted(base_engine: TransformersEngine) -> None:
    t, retries, opened = _play(base_engine, NotATask(Countdown()), NotATask)
    assert (t.finish_reason, retries, opened) == (FinishReason.ENV_ERROR, 0, [])
    assert "raised RuntimeError: not a countdown task" in t.finish_detail
