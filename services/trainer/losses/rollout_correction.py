"""Truncated importance sampling (TIS) for the rollout/trainer mismatch.

The rollout samples with its own engine (vLLM's bf16 kernels on GPU), whose logprobs differ
from the trainer's for the same weights. With the trainer's own logprobs as the clipped
ratio's old policy, each token's policy-gradient term is weighted by
``min(exp(trainer - rollout), cap)``: the importance weight of the sampler's distribution
against the trainer's, truncated so that a token the rollout found far less likely than the
trainer cannot blow up the gradient (Yao et al., 2025; verl's and OpenRLHF's TIS).
"""

from __future__ import annotations

import torch


def truncated_importance_weights(
    trainer_B_T: torch.Tensor, rollout_B_T: torch.Tensor, mask_B_T: torch.Tensor, cap: float
) -> torch.Tensor:
    """``min(exp(trainer - rollout), cap)`` on masked tokens, 1 elsewhere; all 1 when ``cap``
    is 0 (no correction). No gradient flows through the weights."""
    if cap <= 0:
        return torch.ones_like(trainer_B_T)
    log_w_B_T = torch.where(mask_B_T > 0, trainer_B_T.detach() - rollout_B_T.detach(), 0.0)
    return torch.exp(log_w_B_T).clamp(max=cap)
