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
