"""Per-job environment statistics: what a batch of finished episodes says about the env.

A pure function over plain lists (no torch, no gRPC), so the trainer can put the figures in a
job's event stream and tests can check them by hand.
"""

from __future__ import annotations

import math

WIN, LOSS, DRAW = "win", "loss", "draw"
GAME_OUTCOMES = (WIN, LOSS, DRAW)


def summarize_episodes(
    rewards: list[float], turns: list[int], outcomes: list[str]
) -> dict[str, float]:
    """Metrics of finished episodes, one entry per episode in each list.

    rewards: each episode's total reward. turns: each episode's number of env steps.
    outcomes: each episode's ``info["outcome"]`` from its last step ('' when the env reported
    none), or an empty list for environments that report no outcomes.

    Returns ``env_episodes``, ``env_reward_sum``, and, when there is at least one episode,
    ``env_reward_mean`` and ``env_turns_mean``. When some outcome is ``win``, ``loss`` or
    ``draw`` (a game), also ``env_win_rate``, ``env_loss_rate`` and ``env_draw_rate``: shares
    of the episodes that reported one of those three (so they add up to 1). Raises
    ``ValueError`` when the lists disagree in length or a reward is not finite.
    """
    if len(turns) != len(rewards) or (outcomes and len(outcomes) != len(rewards)):
        raise ValueError(
            f"one entry per episode is needed: {len(rewards)} rewards, {len(turns)} turns, "
            f"{len(outcomes)} outcomes (outcomes may also be empty)"
        )
    if not all(math.isfinite(r) for r in rewards):
        raise ValueError(f"rewards must be finite numbers, got {rewards}")
    episodes = len(rewards)
    stats = {"env_episodes": float(episodes), "env_reward_sum": float(math.fsum(rewards))}
    if episodes:
        stats["env_reward_mean"] = stats["env_reward_sum"] / episodes
        stats["env_turns_mean"] = sum(turns) / episodes
    decided = [o for o in outcomes if o in GAME_OUTCOMES]
    if decided:
        for outcome in GAME_OUTCOMES:
            stats[f"env_{outcome}_rate"] = decided.count(outcome) / len(decided)
    return stats


# A step whose episodes end by the turn or token budget this often (or more) is warned about.
TRUNCATION_WARNING_FRACTION = 0.9


def truncated_fraction(truncated_by: list[str]) -> float:
    """Share of episodes that ended by the rollout's budget, not by the env saying done.

    truncated_by: per episode, ``"max_turns"`` or ``"max_tokens"`` when a budget ended it,
    ``""`` when the env did (or it failed). 0.0 for no episodes.
    """
    return sum(bool(t) for t in truncated_by) / len(truncated_by) if truncated_by else 0.0


class TruncationWatch:
    """Says once per job that its episodes end by the budget, not by the environment.

    A job whose every episode is cut at max_turns (or max_episode_tokens) trains on partial
    games and reports nothing wrong; the first step at or over TRUNCATION_WARNING_FRACTION
    gets one warning line for the job's event stream, later steps none.
    """

    def __init__(self) -> None:
        self.warned = False

    def warning(self, step: int, truncated_by: list[str]) -> str | None:
        """The warning for this step's episodes, or None (below the line, or said before)."""
        fraction = truncated_fraction(truncated_by)
        if self.warned or not truncated_by or fraction < TRUNCATION_WARNING_FRACTION:
            return None
        self.warned = True
        turns, tokens = truncated_by.count("max_turns"), truncated_by.count("max_tokens")
        return (
            f"warning: {fraction:.0%} of step {step}'s episodes ended by the rollout's budget, "
            f"not by the environment ({turns} at max_turns, {tokens} at max_episode_tokens): "
            "the job trains on cut-short episodes; raise max_turns / max_episode_tokens (or "
            "leave max_turns unset to use the env's own limit), or check that the env ends "
            "its episodes (done=true)"
        )
