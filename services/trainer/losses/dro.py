"""DRO (Richemond et al., 2024; Kimi Team et al., 2025), as Tinker defines its ``dro`` loss:
an off-policy (even offline) policy gradient with a quadratic penalty on the log-ratio to the
sampler. The advantages are the client's (DRO's soft advantage estimate is computed there)."""

from __future__ import annotations

import torch


def dro_loss(
    logprobs_B_T: torch.Tensor,
    sampling_logprobs_B_T: torch.Tensor,
    advantages_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    *,
    beta: float,
) -> tuple[torch.Tensor, float]:
    """``-sum_bt m_bt * (logp_bt * A_bt - beta/2 * (logp_bt - q_bt)**2)`` and the mean
    squared log-ratio over the masked positions (a metric).

    ``q`` (the sampler's logprobs) and ``A`` carry no gradient; ``mask_B_T`` is 1 on every
    real position (Tinker sums over all of them: positions with A = 0 are pulled towards q
    by the penalty alone). Shapes: all ``B x T``.
    """
    if not logprobs_B_T.shape == sampling_logprobs_B_T.shape == advantages_B_T.shape:
        raise ValueError(
            f"shape mismatch: logprobs {tuple(logprobs_B_T.shape)}, sampling "
            f"{tuple(sampling_logprobs_B_T.shape)}, advantages {tuple(advantages_B_T.shape)}"
        )
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    mask_B_T = mask_B_T.to(logprobs_B_T.dtype)
    q_B_T = sampling_logprobs_B_T.detach().to(logprobs_B_T.dtype)
    a_B_T = advantages_B_T.detach().to(logprobs_B_T.dtype)
    squared_B_T = (logprobs_B_T - q_B_T) ** 2
    objective_B_T = logprobs_B_T * a_B_T - 0.5 * beta * squared_B_T
    count = float(mask_B_T.sum())
    mean_squared = float((squared_B_T.detach() * mask_B_T).sum()) / count if count else 0.0
    return -(objective_B_T * mask_B_T).sum(), mean_squared
