"""What the agent loop is given: the env session it plays through, the episodes to play, the
budgets and sampling of a run (``LoopConfig``) and the turn limit rule."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

import structlog

from opentinker.errors import OpenTinkerError
from opentinker.services.common.tool_calls import ToolCalls
from opentinker.services.rollout.types import ResetResult, StepOutcome
from opentinker.spec import SamplingParams
from opentinker.spec_agent import AgentProgram

log = structlog.get_logger("opentinker.rollout.agent_loop")


class EnvSession(Protocol):
    """One episode of an environment, seen from the rollout.

    ``reset`` and ``step`` raise an ``OpenTinkerError`` (or ``TimeoutError``) when the
    environment fails; the loop ends that episode with ENV_ERROR and the message, or restarts
    it when the error's ``code`` says the env instance died (see ``env_replies``).
    """

    async def reset(self, seed: int, options: Mapping[str, str]) -> ResetResult: ...

    async def step(self, action: str, tool_calls: ToolCalls | None = None) -> StepOutcome:
        """``tool_calls`` is given only for an env that declares tools (see ``tool_calls``)."""
        ...

    async def close(self) -> None: ...


async def close_session(session: EnvSession, episode_id: str) -> None:
    """End an episode's env session; a failure is logged (the episode is over either way)."""
    try:
        await session.close()
    except (OpenTinkerError, TimeoutError) as err:
        log.warning("episode_close_failed", episode_id=episode_id, error=str(err))


@dataclass(frozen=True)
class EpisodeRequest:
    """An episode to play: its id, its GRPO group, the env seed of its reset, its session.

    reopen: a fresh session under a new env episode id, for restarting the episode after its
    env instance died; None = the episode is never restarted.
    """

    episode_id: str
    group_index: int
    seed: int
    session: EnvSession
    reopen: Callable[[str], EnvSession] | None = None


@dataclass(frozen=True)
class LoopConfig:
    """Budgets and sampling of every episode in a run.

    max_turns: the job's limit of model turns per episode; None = the env's own
    (``EnvSpec.max_turns``, or ``DEFAULT_MAX_TURNS`` when the env declares none; see
    ``turn_limit``). max_episode_tokens: prompt + completion tokens.
    max_episode_retries: restarts of one episode after its env instance died.
    max_link_restarts: restarts of one episode after the link to the envs (EnvHub) was lost.
    max_observation_chars: the longest observation (characters) accepted from the env.
    greedy: argmax decoding (evaluation); ``sampling.temperature`` is then not used.
    scheduling: "async" = each episode generates again as soon as its env replied, engine
    calls re-batched from the ready episodes; "lockstep" = rounds of all episodes.
    batch_wait_s: (async) the longest a ready episode waits for others to join an engine
    call; None = half the run's mean engine call (``episode_scheduler``).
    role_adapters: (multi-agent env) the engine serves one LoRA adapter per role: each phase's
    engine call names the acting role's adapter (``multi_agent``); False = one shared policy.
    agent: the job's agent program: it plays each episode through the per-episode
    OpenAI-compatible endpoint (``agent_endpoint``) instead of this loop's turns.
    """

    sampling: SamplingParams
    max_turns: int | None
    max_episode_tokens: int
    env_options: Mapping[str, str] = field(default_factory=dict)
    max_episode_retries: int = 2
    max_link_restarts: int = 5
    max_observation_chars: int = 16384
    greedy: bool = False
    scheduling: Literal["async", "lockstep"] = "async"
    batch_wait_s: float | None = None
    role_adapters: bool = False
    agent: AgentProgram | None = None  # an agent program plays each episode (agent_endpoint)


# Turns per episode when neither the job nor the env sets a limit (the env still ends an
# episode whenever it says done, and max_episode_tokens bounds it too).
DEFAULT_MAX_TURNS = 16


def turn_limit(job_max_turns: int | None, env_max_turns: int) -> int:
    """Model turns an episode may take: the job's max_turns when set (a cap the job chose),
    else the env's own limit (its spec's max_turns), else ``DEFAULT_MAX_TURNS``."""
    if job_max_turns is not None:
        return job_max_turns
    return env_max_turns if env_max_turns > 0 else DEFAULT_MAX_TURNS


def turn_budgets(config: LoopConfig, lengths: list[int]) -> tuple[list[int], SamplingParams]:
    """New tokens each sequence (of these lengths) may take this turn, and the sampling of
    the engine call that serves them all (max_new_tokens = the largest budget)."""
    limits = [
        min(config.sampling.max_new_tokens, config.max_episode_tokens - length)
        for length in lengths
    ]
    return limits, config.sampling.model_copy(update={"max_new_tokens": max(limits)})
