"""What the rollout accepts from an environment, and which env failures it restarts.

EnvHub and the Python SDK check replies too, but an env written in another language (or a
different hub) may not; the rollout checks again so a bad reply ends one episode with a
recorded reason instead of poisoning a batch with NaN rewards or a megabyte prompt.
"""

from __future__ import annotations

import math

from opentinker.errors import OpenTinkerError, UnavailableError

from .types import ResetResult, StepOutcome

# Status codes that mean the episode's env instance died or stopped answering: the episode is
# restarted from Reset (EnvHub routes the new Reset to a live instance). Any other failure is
# the env's own doing (it raised, replied badly, or is not registered) and is final.
RESTARTABLE_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})


class EnvLinkLostError(UnavailableError):
    """The rollout's own link to the environments (its EnvHub stream) broke, not the env.

    Every episode on that link is lost with it (EnvHub keeps no episode across a restart);
    the agent loop starts each over from Reset, on a session that waits for the link to be
    back, without using the episode's ``max_episode_retries`` (those are for env failures).
    """


def is_restartable(err: OpenTinkerError | TimeoutError) -> bool:
    """True when ``err`` says the env instance died or timed out (a bare TimeoutError too)."""
    return isinstance(err, TimeoutError) or err.code in RESTARTABLE_CODES


def reset_problem(reset: ResetResult, max_observation_chars: int) -> str:
    """Why a Reset reply cannot start an episode ('' when it can)."""
    if not reset.system_prompt and not reset.observation:
        return "the reset reply has neither system_prompt nor observation (missing fields)"
    return _size_problem("reset observation", reset.observation, max_observation_chars)


def step_problem(outcome: StepOutcome, max_observation_chars: int) -> str:
    """Why a Step reply cannot be used ('' when it can): a non-finite reward, a huge observation."""
    if not math.isfinite(outcome.reward):
        return f"the step reply has a non-finite reward ({outcome.reward})"
    return _size_problem("step observation", outcome.observation, max_observation_chars)


def _size_problem(what: str, text: str, limit: int) -> str:
    if len(text) > limit:
        return (
            f"the {what} has {len(text)} characters, more than max_observation_chars={limit}; "
            "make the env send less (or raise the limit)"
        )
    return ""
