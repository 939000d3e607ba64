"""GSPO-token (Zheng et al. 2025, arXiv 2507.18071), summed: the session's ``gspo`` loss.

PPO's clipped surrogate with a sequence-level ratio: each sequence's ratio is the geometric
mean of its token ratios over the positions ``ratio_mask`` marks (Tinker's
``sequence_ratio_mask``). Every token carries that value, with the gradient of its own logprob
(the token-level variant Tinker serves), so per-token advantages still work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GspoStats:
    """clip_fraction: share of masked tokens whose sequence ratio lies outside [low, high]."""

    clip_fraction: float


def gspo_loss(
    logprobs_B_T: torch.Tensor,
    sampling_logprobs_B_T: torch.Tensor,
    advantages_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    ratio_mask_B_T: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, GspoStats]:
    """``-sum_bt m_bt * min(s_bt * A_bt, clip(s_bt, clip_low, clip_high) * A_bt)`` with
    ``s_bt = sg(s_b) * exp(logp_bt - sg(logp_bt))`` and
    ``log s_b = mean_{t: ratio_mask_bt != 0} (sg(logp_bt) - sampling_logprobs_bt)``.

    A sequence whose ratio mask is all 0 has ``s_b = 1``. Only ``logprobs_B_T`` carries the
    gradient, through each token's own logprob."""
    if not 0 < clip_low <= 1 <= clip_high:
        raise ValueError(f"need 0 < clip_low <= 1 <= clip_high, got {clip_low}, {clip_high}")
    dtype = logprobs_B_T.dtype
    mask_B_T = mask_B_T.to(dtype)
    in_ratio_B_T = ((ratio_mask_B_T != 0) & (mask_B_T > 0)).to(dtype)
    log_ratio_B_T = (logprobs_B_T.detach() - sampling_logprobs_B_T.to(dtype)) * in_ratio_B_T
    count_B = in_ratio_B_T.sum(dim=1)
    seq_log_ratio_B = log_ratio_B_T.sum(dim=1) / count_B.clamp(min=1.0)
    ratio_B_T = torch.exp(seq_log_ratio_B[:, None] + logprobs_B_T - logprobs_B_T.detach())
    advantages_B_T = advantages_B_T.detach().to(dtype)
    clipped_B_T = ratio_B_T.clamp(clip_low, clip_high)
    objective_B_T = torch.minimum(ratio_B_T * advantages_B_T, clipped_B_T * advantages_B_T)
    loss = -(objective_B_T * mask_B_T).sum()
    seq_ratio_B_T = torch.exp(seq_log_ratio_B)[:, None].expand_as(mask_B_T)
    outside = ((seq_ratio_B_T < clip_low) | (seq_ratio_B_T > clip_high)).to(dtype) * mask_B_T
    fraction = float(outside.sum() / mask_B_T.sum().clamp(min=1.0))
    return loss, GspoStats(clip_fraction=fraction)
