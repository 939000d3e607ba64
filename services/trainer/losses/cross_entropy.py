"""Per-token weighted cross entropy: the SFT loss and the session API's ``cross_entropy``.

    summed:  loss = -sum_t w_t * logp_t                 (Tinker's convention, sessions)
    mean:    loss = -sum_t w_t * logp_t / sum_t w_t     (SFT jobs)

``logp_t`` is the model's log-probability of target token t, ``w_t >= 0`` its weight (0 on
prompt and padding tokens). The sum lets a caller choose the normalisation through the
weights and makes gradient accumulation exact (two calls on halves of a batch give the
gradient of one call on all of it). The mean is over the weighted tokens of the whole batch,
so a long reply counts for more than a short one, as in TRL's and torchtune's SFT.
"""

from __future__ import annotations

import torch


def weighted_nll_sum(logprobs_B_T: torch.Tensor, weights_B_T: torch.Tensor) -> torch.Tensor:
    """``sum_bt -weights_bt * logprobs_bt``; logprobs carry the gradient, weights are constants.
    Both tensors have the same shape."""
    if logprobs_B_T.shape != weights_B_T.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs_B_T.shape)} and weights "
            f"{tuple(weights_B_T.shape)} must have the same shape"
        )
    weights_B_T = weights_B_T.detach().to(logprobs_B_T.dtype)
    # Select rather than multiply, so a -inf logprob at a weight-0 position cannot give nan.
    return -torch.where(weights_B_T != 0, logprobs_B_T * weights_B_T, 0.0).sum()


def cross_entropy(target_logprobs_B_T: torch.Tensor, weights_B_T: torch.Tensor) -> torch.Tensor:
    """Weighted mean negative log-likelihood (a scalar); 0 (with a gradient path) when every
    weight is 0."""
    total = weights_B_T.detach().to(target_logprobs_B_T.dtype).sum()
    tiny = torch.finfo(target_logprobs_B_T.dtype).tiny
    return weighted_nll_sum(target_logprobs_B_T, weights_B_T) / total.clamp(min=tiny)
