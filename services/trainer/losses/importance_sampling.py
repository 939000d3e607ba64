"""REINFORCE with an importance-sampling correction, summed (the session's
``importance_sampling`` loss)."""

from __future__ import annotations

import torch


def importance_sampling_loss(
    logprobs_B_T: torch.Tensor,
    sampling_logprobs_B_T: torch.Tensor,
    advantages_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
) -> torch.Tensor:
    """``-sum_bt m_bt * exp(logprobs_bt - sampling_logprobs_bt) * advantages_bt``.

    The ratio corrects for the sampler's weights differing from the learner's; when they are
    the same its gradient is the plain policy gradient ``-A * grad logp``. ``mask_B_T`` is 1
    on sampled tokens (0 on prompt and padding); only ``logprobs_B_T`` carries the gradient.
    """
    if not logprobs_B_T.shape == sampling_logprobs_B_T.shape == advantages_B_T.shape:
        raise ValueError(
            f"shape mismatch: logprobs {tuple(logprobs_B_T.shape)}, sampling "
            f"{tuple(sampling_logprobs_B_T.shape)}, advantages {tuple(advantages_B_T.shape)}"
        )
    mask_B_T = mask_B_T.to(logprobs_B_T.dtype)
    log_ratio_B_T = torch.where(
        mask_B_T > 0, logprobs_B_T - sampling_logprobs_B_T.detach().to(logprobs_B_T.dtype), 0.0
    )
    ratio_B_T = torch.exp(log_ratio_B_T)
    return -(ratio_B_T * advantages_B_T.detach().to(logprobs_B_T.dtype) * mask_B_T).sum()
