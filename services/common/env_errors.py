"""Env errors of a batch of episodes: how many, of which kinds, the first reason, and the
bound a job puts on their share over a window of recent steps.

Pure functions over the reasons the rollout recorded (a trajectory's ``finish_detail`` when it
ended ENV_ERROR), so the RL loop and the inference job judge env trouble alike and tests can
check the figures by hand. The kind is read from the reason's words, which the rollout writes
(agent_loop.py, env_replies.py): the reasons are the contract, the kinds a summary of them.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

RAISE, TIMEOUT, BAD_REWARD, OVERSIZED, UNREACHABLE, CAPACITY, BAD_REPLY = (
    "raise",
    "timeout",
    "bad_reward",
    "oversized",
    "unreachable",
    "capacity",
    "bad_reply",
)
ENV_ERROR_KINDS = (RAISE, TIMEOUT, BAD_REWARD, OVERSIZED, UNREACHABLE, CAPACITY, BAD_REPLY)

# (kind, words any of which in a reason mean it), the first that matches wins.
_KIND_WORDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (BAD_REWARD, ("non-finite", "s reward ")),
    (OVERSIZED, ("max_observation_chars", "too large", "RESOURCE_EXHAUSTED: received message")),
    (
        TIMEOUT,
        ("DEADLINE_EXCEEDED", "TimeoutError", "timed out", "deadline", "did not answer within"),
    ),
    (CAPACITY, ("CAPACITY_REACHED", "at capacity", "RESOURCE_EXHAUSTED")),
    (
        UNREACHABLE,
        ("UNAVAILABLE", "not registered", "link to the envs", "NOT_FOUND", "is gone", "died"),
    ),
    (BAD_REPLY, ("bad reset reply", "bad reply to step", "missing fields", "not StepResult")),
)


def env_error_kind(reason: str) -> str:
    """The kind of one env error from the reason the rollout recorded (``raise`` when it
    says nothing more specific: the env's own code failed)."""
    for kind, words in _KIND_WORDS:
        if any(word in reason for word in words):
            return kind
    return RAISE


@dataclass(frozen=True)
class EnvErrorTally:
    """Env errors among ``episodes`` episodes: their number, per kind, the first reason."""

    errors: int
    episodes: int
    kinds: dict[str, int] = field(default_factory=dict)
    first_reason: str = ""

    @property
    def fraction(self) -> float:
        return self.errors / self.episodes if self.episodes else 0.0

    def kinds_text(self) -> str:
        """``raise 2, bad_reward 1`` (most first)."""
        return ", ".join(f"{k} {n}" for k, n in sorted(self.kinds.items(), key=lambda kv: -kv[1]))


def tally(reasons: Sequence[str], episodes: int) -> EnvErrorTally:
    """The tally of a batch of ``episodes`` episodes of which those in ``reasons`` (each the
    recorded reason of one ENV_ERROR episode, in episode order) failed."""
    kinds = Counter(env_error_kind(r) for r in reasons)
    first = next((r for r in reasons if r), "no reason recorded" if reasons else "")
    return EnvErrorTally(len(reasons), episodes, dict(kinds), first)


def env_error_metrics(t: EnvErrorTally) -> dict[str, float]:
    """Step figures: ``env_errors``, ``env_error_frac`` and ``env_errors/<kind>`` for every
    kind (0 when none), so charts and alerts see each kind from the first step on."""
    metrics = {"env_errors": float(t.errors), "env_error_frac": t.fraction}
    metrics.update({f"env_errors/{k}": float(t.kinds.get(k, 0)) for k in ENV_ERROR_KINDS})
    return metrics


def env_error_line(env_name: str, where: str, t: EnvErrorTally) -> str:
    """What a person reads of a batch's env errors (a job's event stream, a console)."""
    return (
        f"env '{env_name}': {t.errors} of {t.episodes} episodes failed {where} "
        f"({t.kinds_text()}); first: {t.first_reason}"
    )


class EnvErrorWindow:
    """The share of env errors over the last ``window`` steps, against ``max_fraction``.

    ``add`` one step's tally; it returns why the job must fail, once the window is full (or
    ``final``: the job's last step came first) and more than ``max_fraction`` of its episodes
    failed; else ''. A job is not failed by one unlucky step of a long window.
    """

    def __init__(self, *, env_name: str, max_fraction: float, window: int) -> None:
        if window < 1:
            raise ValueError(f"window: must be >= 1 step, got {window}")
        self.env_name, self.max_fraction = env_name, max_fraction
        self.window = window
        self._steps: deque[EnvErrorTally] = deque(maxlen=window)

    def add(self, t: EnvErrorTally, *, final: bool = False) -> str:
        self._steps.append(t)
        if len(self._steps) < self.window and not final:
            return ""
        total = sum_tallies(list(self._steps))
        where = f"over the last {len(self._steps)} steps"
        return over_fraction(self.env_name, total, self.max_fraction, where)


def over_fraction(env_name: str, t: EnvErrorTally, max_fraction: float, where: str) -> str:
    """Why a job fails when more than ``max_fraction`` of ``t``'s episodes failed; else ''."""
    if t.errors == 0 or t.fraction <= max_fraction:
        return ""
    return (
        f"env '{env_name}' failed {t.errors} of {t.episodes} episodes ({t.fraction:.0%}) "
        f"{where}, more than max_env_error_fraction={max_fraction:g}: {t.kinds_text()}; "
        f"first: {t.first_reason}"
    )


def sum_tallies(tallies: Sequence[EnvErrorTally]) -> EnvErrorTally:
    """One tally of several batches (the first reason of the earliest that has one)."""
    kinds: Counter[str] = Counter()
    for t in tallies:
        kinds.update(t.kinds)
    first = next((t.first_reason for t in tallies if t.first_reason), "")
    return EnvErrorTally(
        sum(t.errors for t in tallies), sum(t.episodes for t in tallies), dict(kinds), first
    )
