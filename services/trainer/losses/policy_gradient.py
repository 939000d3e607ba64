"""The clipped policy-gradient surrogate (PPO, GRPO) and its normalization choices.

Dimension names in variable suffixes: ``B`` sequences, ``T`` token positions (logprob of token
t+1 given tokens 0..t).

    loss = -sum_bt w_bt * min(ratio_bt * A_bt, clip(ratio_bt, 1-eps, 1+eps) * A_bt)
    ratio_bt = exp(new_bt - old_bt)

The weights ``w_bt`` (0 off the mask) say how tokens are averaged; they are computed once for
the whole batch, so a loss summed over micro-batches equals the full-batch loss:

- ``sequence`` (GRPO paper, eq. 3): ``m_bt / (|o_b| * B)`` -- the mean over each sequence's
  tokens, then the mean over sequences; every episode weighs the same whatever its length.
- ``token`` (DAPO): ``m_bt / sum(m)`` -- the token mean over the batch; long sequences weigh
  more, the 1/|o_b| length bias is gone.
- ``constant`` (Dr. GRPO): ``m_bt / (B * max_tokens)`` -- a sum divided by a constant, so neither
  the length of a sequence nor that of the batch rescales a token's gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Normalization = Literal["sequence", "token", "constant"]


def sequence_scales(
    tokens_B: torch.Tensor, normalization: Normalization, *, max_tokens: int = 0
) -> torch.Tensor:
    """The weight ``[B]`` each masked token of a sequence gets, from the sequences' masked token
    counts (``tokens_B``); see the module doc. ``max_tokens``: constant of ``constant`` (> 0)."""
    tokens_B = tokens_B.to(torch.float32)
    size = max(tokens_B.shape[0], 1)
    if normalization == "sequence":
        return 1.0 / tokens_B.clamp(min=1.0) / size
    if normalization == "token":
        return torch.full_like(tokens_B, 1.0) / tokens_B.sum().clamp(min=1.0)
    if normalization == "constant":
        if max_tokens <= 0:
            raise ValueError(f"constant normalization needs max_tokens > 0, got {max_tokens}")
        return torch.full_like(tokens_B, 1.0 / (size * max_tokens))
    raise ValueError(f"unknown normalization {normalization!r}: use sequence, token or constant")


def token_weights(
    mask_B_T: torch.Tensor, normalization: Normalization, *, max_tokens: int = 0
) -> torch.Tensor:
    """Per-token weights ``[B, T]`` of one batch: the mask times each sequence's scale."""
    mask_B_T = mask_B_T.to(torch.float32)
    scales_B = sequence_scales(mask_B_T.sum(dim=1), normalization, max_tokens=max_tokens)
    return mask_B_T * scales_B.unsqueeze(1)


@dataclass(frozen=True)
class ClipStats:
    """Figures of one loss evaluation (plain floats, detached), over ``tokens`` masked tokens.

    clip_fraction: share of masked tokens whose ratio lies outside [1-eps, 1+eps].
    ratio_mean: mean of exp(new - old) over masked tokens.
    """

    clip_fraction: float
    ratio_mean: float
    tokens: int = 0


def clipped_policy_loss(
    new_logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor,
    advantages_B_T: torch.Tensor,
    weights_B_T: torch.Tensor,
    clip_epsilon: float,
    *,
    clip_high_epsilon: float | None = None,
) -> tuple[torch.Tensor, ClipStats]:
    """The clipped surrogate, to be minimized (see the module doc). The ratio is clipped to
    [1 - clip_epsilon, 1 + clip_high_epsilon] (clip_high_epsilon None: clip_epsilon; a larger
    one is DAPO's clip-higher).

    new_logprobs_B_T carries the gradient; old logprobs (those the rollout sampled with, or
    those of the policy before this batch's first update) and advantages are constants.
    advantages: ``[B, T]`` per token or ``[B]`` per sequence. The mask is ``weights > 0``;
    masked-out tokens contribute nothing, whatever their values (even inf).
    """
    if advantages_B_T.dim() == 1:
        advantages_B_T = advantages_B_T.unsqueeze(1).expand_as(new_logprobs_B_T)
    shapes = {tuple(t.shape) for t in (new_logprobs_B_T, old_logprobs_B_T, advantages_B_T)}
    if len(shapes | {tuple(weights_B_T.shape)}) != 1:
        raise ValueError(
            f"shape mismatch: new {tuple(new_logprobs_B_T.shape)}, old "
            f"{tuple(old_logprobs_B_T.shape)}, advantages {tuple(advantages_B_T.shape)}, "
            f"mask/weights {tuple(weights_B_T.shape)}"
        )
    dtype = new_logprobs_B_T.dtype
    on_B_T = weights_B_T > 0
    weights_B_T = weights_B_T.to(dtype)
    adv_B_T = torch.where(on_B_T, advantages_B_T.detach().to(dtype), 0.0)
    # Select (not multiply) the log-ratio on the mask, so padding can never give inf * 0 = nan.
    log_ratio_B_T = torch.where(on_B_T, new_logprobs_B_T - old_logprobs_B_T.detach().to(dtype), 0.0)
    ratio_B_T = torch.exp(log_ratio_B_T)
    low = 1.0 - clip_epsilon
    high = 1.0 + (clip_epsilon if clip_high_epsilon is None else clip_high_epsilon)
    clipped_B_T = torch.clamp(ratio_B_T, low, high)
    surrogate_B_T = torch.minimum(ratio_B_T * adv_B_T, clipped_B_T * adv_B_T)
    loss = -(surrogate_B_T * weights_B_T).sum()
    with torch.no_grad():
        on = on_B_T.to(dtype)
        total = on.sum().clamp(min=1.0)
        outside_B_T = (ratio_B_T < low) | (ratio_B_T > high)
        stats = ClipStats(
            clip_fraction=float((outside_B_T.to(dtype) * on).sum() / total),
            ratio_mean=float((ratio_B_T * on).sum() / total),
            tokens=int(on.sum()),
        )
    return loss, stats


def grpo_loss(
    new_logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_T: torch.Tensor,
    clip_epsilon: float,
    normalization: Normalization = "sequence",
    *,
    max_tokens: int = 0,
) -> tuple[torch.Tensor, ClipStats]:
    """The clipped surrogate of one whole batch with weights from ``mask_B_T`` (1 on tokens the
    policy generated). With the default ``sequence`` normalization, a sequence with no masked
    token contributes 0 but still counts in the mean over sequences."""
    if new_logprobs_B_T.shape != mask_B_T.shape:
        raise ValueError(
            f"shape mismatch: new {tuple(new_logprobs_B_T.shape)}, mask {tuple(mask_B_T.shape)}"
        )
    weights_B_T = token_weights(mask_B_T, normalization, max_tokens=max_tokens)
    return clipped_policy_loss(
        new_logprobs_B_T, old_logprobs_B_T, advantages_B, weights_B_T, clip_epsilon
    )
