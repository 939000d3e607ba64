"""CISPO (MiniMax-M1, arXiv 2506.13585), token-level and summed: the session's ``cispo`` loss.

Unlike PPO it never drops a token's gradient: the importance ratio is clipped and then held
constant (no gradient), and it weights the plain policy-gradient term ``A * logp``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CispoStats:
    """clip_fraction: share of masked tokens whose ratio lies outside [low, high]."""

    clip_fraction: float


def cispo_loss(
    logprobs_B_T: torch.Tensor,
    sampling_logprobs_B_T: torch.Tensor,
    advantages_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, CispoStats]:
    """``-sum_bt m_bt * sg(clip(r_bt, clip_low, clip_high)) * A_bt * logprobs_bt``,
    ``r = exp(logprobs - sampling_logprobs)``, ``sg`` = stop-gradient."""
    if not 0 < clip_low <= 1 <= clip_high:
        raise ValueError(f"need 0 < clip_low <= 1 <= clip_high, got {clip_low}, {clip_high}")
    mask_B_T = mask_B_T.to(logprobs_B_T.dtype)
    log_ratio_B_T = torch.where(
        mask_B_T > 0, logprobs_B_T.detach() - sampling_logprobs_B_T.to(logprobs_B_T.dtype), 0.0
    )
    ratio_B_T = torch.exp(log_ratio_B_T)
    weight_B_T = ratio_B_T.clamp(clip_low, clip_high)
    advantages_B_T = advantages_B_T.detach().to(logprobs_B_T.dtype)
    loss = -(weight_B_T * advantages_B_T * logprobs_B_T * mask_B_T).sum()
    clipped = ((ratio_B_T < clip_low) | (ratio_B_T > clip_high)).to(mask_B_T.dtype) * mask_B_T
    fraction = float(clipped.sum() / mask_B_T.sum().clamp(min=1.0))
    return loss, CispoStats(clip_fraction=fraction)
