"""Per-token weighted cross entropy: the SFT loss (and the ``cross_entropy`` of Tinker's API).

    loss = -sum_t w_t * logp_t / sum_t w_t

``logp_t`` is the model's log-probability of target token t, ``w_t >= 0`` its weight (0 on
prompt and padding tokens). The mean is over the weighted tokens of the whole batch, so a long
reply counts for more than a short one, as in TRL's and torchtune's SFT.
"""

from __future__ import annotations

import torch


def cross_entropy(target_logprobs_B_T: torch.Tensor, weights_B_T: torch.Tensor) -> torch.Tensor:
    """Weighted mean negative log-likelihood (a scalar); 0 (with a gradient path) when every
    weight is 0. Both tensors have the same shape; weights carry no gradient."""
    if target_logprobs_B_T.shape != weights_B_T.shape:
        raise ValueError(
            f"logprobs {tuple(target_logprobs_B_T.shape)} and weights "
            f"{tuple(weights_B_T.shape)} must have the same shape"
        )
    weights = weights_B_T.detach().to(target_logprobs_B_T.dtype)
    total = weights.sum()
    return -(target_logprobs_B_T * weights).sum() / total.clamp(min=torch.finfo(weights.dtype).tiny)


def target_logprobs(logits_B_L_V: torch.Tensor, tokens_B_L: torch.Tensor) -> torch.Tensor:
    """``[B, L-1]``: log p(tokens[:, t+1] | tokens[:, :t+1]) from the logits at t, in float32
    (computed by ``F.cross_entropy``, which does not keep a [B, T, V] log-softmax copy)."""
    logits_B_T_V = logits_B_L_V[:, :-1].float()
    targets_B_T = tokens_B_L[:, 1:]
    nll = torch.nn.functional.cross_entropy(
        logits_B_T_V.reshape(-1, logits_B_T_V.shape[-1]), targets_B_T.reshape(-1), reduction="none"
    )
    return -nll.view_as(targets_B_T)
