"""Per-turn discounted returns of a multi-turn episode.

An episode of K turns has one reward per environment step, ``r_0 .. r_{K-1}``. The return of
turn k is what follows from it: ``G_k = r_k + gamma * G_{k+1}`` (``G_K = 0``). Every model token
of turn k is credited with ``G_k``, so an early move is judged by the rewards it led to, and a
move after the decisive one is not credited with it.

Turn boundaries are completion-token indices: ``turn_ends[k]`` is the index just after the last
model token of turn k (exclusive end, counted from the first completion token; a turn without
model tokens ends
where the previous one did). Completion
token j belongs to the first turn k with ``j < turn_ends[k]``; tokens after the last turn end
(trailing observation tokens) belong to the last turn.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def discounted_returns(turn_rewards: Sequence[float], gamma: float) -> list[float]:
    """``G_k = r_k + gamma * G_{k+1}`` for each turn, first turn first."""
    returns: list[float] = []
    following = 0.0
    for reward in reversed(turn_rewards):
        following = reward + gamma * following
        returns.append(following)
    return returns[::-1]


def token_returns(
    turn_rewards: Sequence[float],
    turn_ends: Sequence[int],
    completion_length: int,
    gamma: float,
) -> torch.Tensor:
    """The return of each completion token's turn, shape ``[completion_length]``."""
    if len(turn_rewards) != len(turn_ends) or not turn_rewards:
        raise ValueError(
            f"need one turn end per turn reward, got {len(turn_rewards)} rewards and "
            f"{len(turn_ends)} ends"
        )
    if list(turn_ends) != sorted(turn_ends) or not 0 <= turn_ends[0] <= turn_ends[-1] <= (
        completion_length
    ):
        raise ValueError(
            f"turn ends {list(turn_ends)} must not decrease and lie within 0..{completion_length}"
        )
    returns = discounted_returns(turn_rewards, gamma)
    out = torch.full((completion_length,), returns[-1], dtype=torch.float32)
    start = 0
    for end, value in zip(turn_ends, returns, strict=True):
        out[start:end] = value
        start = end
    return out
