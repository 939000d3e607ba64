"""PPO's clipped surrogate per token, summed (the session's ``ppo`` loss).

Token-level and summed as in Tinker: each token's advantage is given by the caller (a
sequence's advantage repeated on its tokens, scaled as the caller wishes). The clip bounds are
on the probability ratio itself (e.g. 0.8 and 1.2), so they may be asymmetric (DAPO's
clip-higher).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opentinker.services.trainer.losses.policy_gradient import clipped_policy_loss


@dataclass(frozen=True)
class PpoTokenStats:
    """clip_fraction: share of masked tokens whose ratio lies outside [low, high]."""

    clip_fraction: float


def ppo_token_loss(
    logprobs_B_T: torch.Tensor,
    sampling_logprobs_B_T: torch.Tensor,
    advantages_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, PpoTokenStats]:
    """``-sum_bt m_bt * min(r_bt * A_bt, clip(r_bt, clip_low, clip_high) * A_bt)``,
    ``r = exp(logprobs - sampling_logprobs)``; only ``logprobs_B_T`` carries the gradient."""
    if not 0 < clip_low <= 1 <= clip_high:
        raise ValueError(f"need 0 < clip_low <= 1 <= clip_high, got {clip_low}, {clip_high}")
    loss, stats = clipped_policy_loss(
        logprobs_B_T,
        sampling_logprobs_B_T,
        advantages_B_T,
        mask_B_T.to(logprobs_B_T.dtype),
        1.0 - clip_low,
        clip_high_epsilon=clip_high - 1.0,
    )
    return loss, PpoTokenStats(clip_fraction=stats.clip_fraction)
