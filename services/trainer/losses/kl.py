"""KL divergence to a reference policy, estimated from the sampled tokens (Schulman, 2020).

With ``log_ratio = new - ref`` (log pi(x) - log pi_ref(x), x sampled from pi):

- ``k1 = log_ratio``: unbiased for KL(pi || pi_ref), high variance, can be negative per token.
- ``k3 = exp(-log_ratio) - 1 + log_ratio``: unbiased too, always >= 0, lower variance.

Used either as a loss term (``kl_loss``: its gradient pulls the policy toward the reference) or
subtracted from the per-token reward (``kl_reward_penalty``, a constant: PPO-RLHF style).
"""

from __future__ import annotations

from typing import Literal

import torch

KlEstimator = Literal["k1", "k3"]


def kl_per_token(
    new_logprobs_B_T: torch.Tensor, ref_logprobs_B_T: torch.Tensor, estimator: KlEstimator
) -> torch.Tensor:
    """The per-token KL estimate ``[B, T]`` (gradient flows through ``new``; ``ref`` is
    constant). Values off the mask are meaningless: weight them by 0."""
    log_ratio_B_T = new_logprobs_B_T - ref_logprobs_B_T.detach()
    if estimator == "k1":
        return log_ratio_B_T
    if estimator == "k3":
        return torch.exp(-log_ratio_B_T) - 1.0 + log_ratio_B_T
    raise ValueError(f"unknown KL estimator {estimator!r}: use k1 or k3")


def kl_loss(
    new_logprobs_B_T: torch.Tensor,
    ref_logprobs_B_T: torch.Tensor,
    weights_B_T: torch.Tensor,
    estimator: KlEstimator,
) -> torch.Tensor:
    """``sum_bt w_bt * kl_bt`` (weights from ``token_weights``; 0 off the mask)."""
    kl_B_T = kl_per_token(new_logprobs_B_T, ref_logprobs_B_T, estimator)
    on_B_T = weights_B_T > 0
    return (torch.where(on_B_T, kl_B_T, 0.0) * weights_B_T.to(kl_B_T.dtype)).sum()


def kl_reward_penalty(
    sampled_logprobs_B_T: torch.Tensor,
    ref_logprobs_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    *,
    coef: float,
    estimator: KlEstimator,
) -> torch.Tensor:
    """``-coef * kl_bt`` on masked tokens, 0 elsewhere: a constant to add to per-token rewards."""
    with torch.no_grad():
        kl_B_T = kl_per_token(sampled_logprobs_B_T.detach(), ref_logprobs_B_T, estimator)
        return torch.where(mask_B_T > 0, -coef * kl_B_T, 0.0)
