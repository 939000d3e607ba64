"""RLOO advantages (Ahmadian et al., 2024): each sample's baseline is the mean reward of the
*other* samples of its group, ``A_i = r_i - (sum_g - r_i) / (N - 1)``.

Equivalently ``N / (N - 1) * (r_i - mean_g)``: unbiased (the baseline does not depend on the
sample itself) and not divided by the std, so the scale of the rewards is kept.
"""

from __future__ import annotations

import torch

from opentinker.services.trainer.estimators.grpo import check_groups


def rloo_advantages(rewards_G_N: torch.Tensor) -> torch.Tensor:
    """Leave-one-out advantages, shape ``[G, N]`` (``N >= 2``)."""
    rewards_G_N = check_groups(rewards_G_N, min_samples=2)
    n = rewards_G_N.shape[1]
    others_G_N = (rewards_G_N.sum(dim=1, keepdim=True) - rewards_G_N) / (n - 1)
    return rewards_G_N - others_G_N
