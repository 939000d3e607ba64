"""StableReinforce, summed: the session's ``stable_reinforce`` loss (Tinker's default RL loss
in tinker-cookbook's rl_loop).

Tinker documents what the loss needs (the sampler's record of each sampled sequence, named by
provenance; ``kl_coeff`` in loss_fn_config) but not its formula, so this is OpenTinker's own
REINFORCE that stays bounded off-policy: each token's policy-gradient term is weighted by its
importance ratio truncated at 1 and held constant, so a token the learner now finds likelier
than the sampler did is never amplified, and on-policy (ratio 1) it is plain REINFORCE; an
optional KL term pulls the learner back towards the sampler that made the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StableReinforceStats:
    """truncated_fraction: share of masked tokens whose ratio exceeds 1 (weight cut to 1);
    kl: the summed KL estimate (before ``kl_coeff``)."""

    truncated_fraction: float
    kl: float


def stable_reinforce_loss(
    logprobs_B_T: torch.Tensor,
    sampling_logprobs_B_T: torch.Tensor,
    advantages_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    *,
    kl_coeff: float,
) -> tuple[torch.Tensor, StableReinforceStats]:
    """``-sum_bt m_bt * sg(min(r_bt, 1)) * A_bt * logp_bt
    + kl_coeff * sum_bt m_bt * (r_bt - 1 - log r_bt)``, ``r = exp(logp - sampling_logprobs)``.

    The second sum is the k3 estimate of KL(sampler || learner) on the sampler's tokens (>= 0,
    0 where they agree). ``sampling_logprobs_B_T`` are the sampler's recorded logprobs of the
    targets; only ``logprobs_B_T`` carries the gradient."""
    if kl_coeff < 0:
        raise ValueError(f"kl_coeff must be >= 0, got {kl_coeff}")
    dtype = logprobs_B_T.dtype
    mask_B_T = mask_B_T.to(dtype)
    log_ratio_B_T = torch.where(mask_B_T > 0, logprobs_B_T - sampling_logprobs_B_T.to(dtype), 0.0)
    ratio_B_T = torch.exp(log_ratio_B_T)
    weight_B_T = ratio_B_T.detach().clamp(max=1.0)
    advantages_B_T = advantages_B_T.detach().to(dtype)
    pg = -(weight_B_T * advantages_B_T * logprobs_B_T * mask_B_T).sum()
    kl = ((ratio_B_T - 1.0 - log_ratio_B_T) * mask_B_T).sum()
    truncated = (ratio_B_T.detach() > 1.0).to(dtype) * mask_B_T
    fraction = float(truncated.sum() / mask_B_T.sum().clamp(min=1.0))
    stats = StableReinforceStats(truncated_fraction=fraction, kl=float(kl.detach()))
    return pg + kl_coeff * kl, stats
