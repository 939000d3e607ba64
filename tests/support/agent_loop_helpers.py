"""The agent loop's test harness: in-process games (GameSession plays an AbstractGame without
gRPC, RoleSession one with roles; Countdown), the real engine recording what it generated
(RecordingEngine), play(), which runs a batch of episodes through AgentLoop and checks its
stats, and model_turns(). The tiny engine itself is conftest's ``base_engine``. Used by
test_agent_loop.py, test_episode_scheduler.py, test_multi_turn_returns.py, test_multi_agent.py
and test_role_adapters.py.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence

from opentinker.errors import EnvironmentError_
from opentinker.game import AbstractGame, StepResult, first_user_message
from opentinker.services.rollout.agent.agent_loop import AgentLoop
from opentinker.services.rollout.agent.loop_config import EpisodeRequest, LoopConfig
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.types import (
    Completion,
    ResetResult,
    StepOutcome,
    Trajectory,
)
from opentinker.spec import SamplingParams


class GameSession:
    """An ``EnvSession`` that plays an ``AbstractGame`` in-process (no gRPC)."""

    def __init__(self, game: AbstractGame) -> None:
        self.game = game
        self.actions: list[str] = []
        self.closed = False

    async def reset(self, seed: int, options: Mapping[str, str]) -> ResetResult:
        observation = self.game.reset(seed=seed, **options)
        intro = self.game.get_initial_user_message()
        return ResetResult(self.game.get_system_prompt(), first_user_message(intro, observation))

    async def step(self, action: str) -> StepOutcome:
        self.actions.append(action)
        try:
            result = self.game.step(action)
        except Exception as err:
            raise EnvironmentError_(f"environment '{self.game.name}' raised: {err}") from err
        return StepOutcome(result.observation, result.reward, result.done, result.info)

    async def close(self) -> None:
        self.closed = True


class RoleSession:
    """An ``EnvSession`` that plays a game with roles in-process (the env server's view)."""

    def __init__(self, game: AbstractGame) -> None:
        self.game = game
        self.closed = False

    async def reset(self, seed: int, options: Mapping[str, str]) -> ResetResult:
        observation = self.game.reset(seed=seed, **options)
        message = first_user_message(self.game.get_initial_user_message(), observation)
        return ResetResult(self.game.get_system_prompt(), message, next_role=self.game.first_role())

    async def step(self, action: str) -> StepOutcome:
        r = self.game.step(action)
        return StepOutcome(
            r.observation,
            r.reward,
            r.done,
            r.info,
            next_role=r.next_role,
            role_rewards=dict(r.role_rewards),
        )

    async def close(self) -> None:
        self.closed = True


class Countdown(AbstractGame):
    """Ends after ``turns`` steps (never, when 0); reward 0.25 per step; prompt from the seed."""

    name = "countdown"

    def __init__(self, turns: int = 1, fail_on_step: int = 0) -> None:
        self.turns, self.fail_on_step = turns, fail_on_step

    def get_system_prompt(self) -> str:
        return "Count down with me."

    def reset(self, *, seed: int = 0) -> str:
        self.number = random.Random(seed).randrange(1000)
        self.steps = 0
        return f"Start at {self.number}."

    def step(self, action: str) -> StepResult:
        self.steps += 1
        if self.steps == self.fail_on_step:
            raise RuntimeError("out of cheese")
        done = self.turns > 0 and self.steps >= self.turns
        return StepResult(
            observation=f"Now {self.number - self.steps}, go on.", reward=0.25, done=done
        )


class RecordingEngine:
    """The real engine, keeping every completion it returned and counting generate calls."""

    def __init__(self, engine: TransformersEngine) -> None:
        self.inner = engine
        self.name = engine.name
        self.tokenizer = engine.tokenizer
        self.calls: list[int] = []  # batch size of each generate call
        self.completions: list[Completion] = []

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int
    ) -> list[Completion]:
        out = self.inner.generate(prompts, sampling, seed)
        self.calls.append(len(prompts))
        self.completions.extend(out)
        return out

    def apply_weights(self, tensors, policy_version):  # noqa: ANN001, ANN201 - pass-through
        return self.inner.apply_weights(tensors, policy_version)

    def logprobs_of(self, token_ids: Sequence[int]) -> list[float]:
        return self.inner.logprobs_of(token_ids)


def play(
    engine: RecordingEngine,
    sessions: list[GameSession],
    *,
    max_turns: int = 1,
    max_new_tokens: int = 8,
    max_episode_tokens: int = 512,
    seeds: list[int] | None = None,
) -> list[Trajectory]:
    config = LoopConfig(
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens),
        max_turns=max_turns,
        max_episode_tokens=max_episode_tokens,
    )
    requests = [
        EpisodeRequest(f"ep-{n}", n, (seeds or list(range(len(sessions))))[n], session)
        for n, session in enumerate(sessions)
    ]
    trajectories, stats = asyncio.run(AgentLoop(engine, config).run(requests, seed=42))  # type: ignore[arg-type]
    assert stats.generated_tokens == sum(sum(t.loss_mask) for t in trajectories)
    assert (stats.generate_seconds > 0) == (stats.generated_tokens > 0)
    assert stats.env_seconds > 0
    assert all(s.closed for s in sessions)
    return trajectories


def model_turns(t: Trajectory) -> list[list[int]]:
    """The completion split into runs of loss-mask-1 tokens (one run per model turn)."""
    completion = t.token_ids[t.prompt_length :]
    turns: list[list[int]] = []
    for i, (tok, mask) in enumerate(zip(completion, t.loss_mask, strict=True)):
        if mask == 1:
            if i == 0 or t.loss_mask[i - 1] == 0:
                turns.append([])
            turns[-1].append(tok)
    return turns
