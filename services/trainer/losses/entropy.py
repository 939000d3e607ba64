"""Entropy of the next-token distribution, and the entropy bonus that keeps exploring."""

from __future__ import annotations

import torch


def entropy_from_logprobs(logprobs_B_T_V: torch.Tensor) -> torch.Tensor:
    """``H = -sum_v p_v log p_v`` per position, ``[B, T]`` (log-softmaxed input; keeps the
    gradient)."""
    return -(logprobs_B_T_V.exp() * logprobs_B_T_V).sum(dim=-1)


def entropy_bonus_loss(entropy_B_T: torch.Tensor, weights_B_T: torch.Tensor) -> torch.Tensor:
    """``-sum_bt w_bt * H_bt``: minimizing it raises the entropy (multiply by the coefficient)."""
    on_B_T = weights_B_T > 0
    return -(torch.where(on_B_T, entropy_B_T, 0.0) * weights_B_T.to(entropy_B_T.dtype)).sum()
