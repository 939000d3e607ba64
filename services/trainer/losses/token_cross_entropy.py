"""Weighted next-token cross-entropy, summed (the session API's ``cross_entropy``).

Tinker's convention: the loss is a sum over tokens and sequences, not a mean, so a caller
chooses the normalisation through the weights (e.g. 1 / completion tokens). Summing also
makes gradient accumulation exact: two calls on halves of a batch give the gradient of one
call on all of it.
"""

from __future__ import annotations

import torch


def token_cross_entropy(logprobs_B_T: torch.Tensor, weights_B_T: torch.Tensor) -> torch.Tensor:
    """``sum_bt -weights_bt * logprobs_bt``; logprobs carry the gradient, weights are constants
    (0 on prompt and padding positions)."""
    if logprobs_B_T.shape != weights_B_T.shape:
        raise ValueError(
            f"shape mismatch: logprobs {tuple(logprobs_B_T.shape)}, "
            f"weights {tuple(weights_B_T.shape)}"
        )
    weights_B_T = weights_B_T.detach().to(logprobs_B_T.dtype)
    # Select rather than multiply, so a -inf logprob at a weight-0 position cannot give nan.
    return -torch.where(weights_B_T != 0, logprobs_B_T * weights_B_T, 0.0).sum()
