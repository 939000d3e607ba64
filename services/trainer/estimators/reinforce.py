"""REINFORCE with a baseline: ``A_b = r_b - mean(r)`` over the whole batch (no grouping, no
std division). The batch mean lowers the variance of the gradient without biasing it much."""

from __future__ import annotations

import torch


def batch_baseline_advantages(rewards_B: torch.Tensor) -> torch.Tensor:
    """``r - mean(r)`` of a ``[B]`` reward vector (``B >= 1``)."""
    if rewards_B.dim() != 1 or rewards_B.numel() == 0:
        raise ValueError(
            f"rewards must be a non-empty [batch] vector, got {tuple(rewards_B.shape)}"
        )
    rewards_B = rewards_B.to(torch.float32)
    return rewards_B - rewards_B.mean()
