"""GRPO group-normalized advantages (Shao et al., 2024): ``(r - mean_g) / (std_g + eps)``.

Dimension names in variable suffixes: ``G`` groups (prompts), ``N`` samples per group.
"""

from __future__ import annotations

import torch

ADVANTAGE_EPS = 1e-6


def check_groups(rewards_G_N: torch.Tensor, min_samples: int = 1) -> torch.Tensor:
    """``rewards_G_N`` as float32 after checking it is ``[groups, samples >= min_samples]``."""
    if rewards_G_N.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples], got shape {tuple(rewards_G_N.shape)}")
    if rewards_G_N.shape[1] < min_samples:
        raise ValueError(
            f"rewards must have at least {min_samples} samples per group, "
            f"got shape {tuple(rewards_G_N.shape)}"
        )
    return rewards_G_N.to(torch.float32)


def group_advantages(rewards_G_N: torch.Tensor, eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """Advantages ``(r - mean_g) / (std_g + eps)`` per group, shape ``[G, N]``.

    ``std`` is the population standard deviation (``unbiased=False``). A group whose rewards
    are all equal carries no learning signal and gets exactly 0 advantage (its numerator is 0).
    """
    rewards_G_N = check_groups(rewards_G_N)
    mean_G_1 = rewards_G_N.mean(dim=1, keepdim=True)
    std_G_1 = rewards_G_N.std(dim=1, unbiased=False, keepdim=True)
    return (rewards_G_N - mean_G_1) / (std_G_1 + eps)
