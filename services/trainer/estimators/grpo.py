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
    are all equal carries no learning signal and gets exactly 0 advantage (``flat_groups``).
    """
    rewards_G_N = check_groups(rewards_G_N).to(torch.float64)
    mean_G_1 = rewards_G_N.mean(dim=1, keepdim=True)
    std_G_1 = rewards_G_N.std(dim=1, unbiased=False, keepdim=True)
    advantages_G_N = (rewards_G_N - mean_G_1) / (std_G_1 + eps)
    return torch.where(flat_groups(rewards_G_N), 0.0, advantages_G_N).to(torch.float32)


def flat_groups(rewards_G_N: torch.Tensor) -> torch.Tensor:
    """``[G, 1]``: True where a group's rewards are all equal, to rounding. Their mean is not
    exactly the reward in float32 (three rewards of 0.9), so the std came out ~5e-8 instead
    of 0 and each member got a same-signed advantage (0.056 there), or a per-turn scale
    1/std of ~1e6 in multi-turn GRPO."""
    spread_G_1 = rewards_G_N.amax(dim=1, keepdim=True) - rewards_G_N.amin(dim=1, keepdim=True)
    size_G_1 = rewards_G_N.abs().amax(dim=1, keepdim=True).clamp(min=1.0)
    return spread_G_1 <= 1e-6 * size_G_1
