"""GRPO: group-normalized advantages and the clipped policy-gradient loss.

Pure tensor functions, no model and no I/O. Dimension names in variable suffixes:
``G`` groups (prompts), ``N`` samples per group, ``B`` sequences (= G * N, flattened group-major),
``T`` token positions (logprob of token t+1 given tokens 0..t).

Loss reduction: per sequence, the mean over its masked (model-generated) tokens; then the mean
over sequences. This is the reduction of the GRPO paper (Shao et al., 2024, eq. 3: 1/G sum_i
1/|o_i| sum_t). Each episode weighs the same whatever its length, so a long rambling answer
does not get more say than a short one. The alternative, token-mean over the whole batch
(DAPO, Dr. GRPO), weighs long sequences more and removes the length bias of the 1/|o_i| term;
for the short single-turn tasks here the two agree closely and sequence-mean is the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ADVANTAGE_EPS = 1e-6


def group_advantages(rewards_G_N: torch.Tensor, eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """Advantages ``(r - mean_g) / (std_g + eps)`` per group, shape ``[G, N]``.

    ``std`` is the population standard deviation (``unbiased=False``). A group whose rewards
    are all equal carries no learning signal and gets exactly 0 advantage (its numerator is 0).
    """
    if rewards_G_N.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples], got shape {tuple(rewards_G_N.shape)}")
    rewards_G_N = rewards_G_N.to(torch.float32)
    mean_G_1 = rewards_G_N.mean(dim=1, keepdim=True)
    std_G_1 = rewards_G_N.std(dim=1, unbiased=False, keepdim=True)
    return (rewards_G_N - mean_G_1) / (std_G_1 + eps)


@dataclass(frozen=True)
class GrpoStats:
    """Figures of one loss evaluation (plain floats, detached).

    clip_fraction: share of masked tokens whose ratio lies outside [1-eps, 1+eps].
    ratio_mean: mean of exp(new - old) over masked tokens.
    """

    clip_fraction: float
    ratio_mean: float


def grpo_loss(
    new_logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_T: torch.Tensor,
    clip_epsilon: float,
) -> tuple[torch.Tensor, GrpoStats]:
    """The clipped GRPO surrogate, to be minimized.

    loss = -mean_b [ sum_t m_bt * min(ratio_bt * A_b, clip(ratio_bt, 1-eps, 1+eps) * A_b)
                     / max(sum_t m_bt, 1) ],   ratio_bt = exp(new_bt - old_bt)

    new_logprobs_B_T carries the gradient; old_logprobs_B_T (the sampling logprobs) and
    advantages_B are constants. mask_B_T is 1 on tokens the policy generated, 0 elsewhere
    (prompt, environment observations, padding); masked-out tokens contribute nothing. A
    sequence with no masked token contributes 0 but still counts in the mean over sequences.
    """
    if new_logprobs_B_T.shape != old_logprobs_B_T.shape or new_logprobs_B_T.shape != mask_B_T.shape:
        raise ValueError(
            f"shape mismatch: new {tuple(new_logprobs_B_T.shape)}, old "
            f"{tuple(old_logprobs_B_T.shape)}, mask {tuple(mask_B_T.shape)}"
        )
    mask_B_T = mask_B_T.to(new_logprobs_B_T.dtype)
    old_B_T = old_logprobs_B_T.detach().to(new_logprobs_B_T.dtype)
    adv_B_1 = advantages_B.detach().to(new_logprobs_B_T.dtype).unsqueeze(1)
    # Select (not multiply) the log-ratio on the mask, so padding can never give inf * 0 = nan.
    log_ratio_B_T = torch.where(mask_B_T > 0, new_logprobs_B_T - old_B_T, 0.0)
    ratio_B_T = torch.exp(log_ratio_B_T)
    clipped_B_T = torch.clamp(ratio_B_T, 1.0 - clip_epsilon, 1.0 + clip_epsilon)
    surrogate_B_T = torch.minimum(ratio_B_T * adv_B_1, clipped_B_T * adv_B_1)
    tokens_B = mask_B_T.sum(dim=1)
    per_sequence_B = (surrogate_B_T * mask_B_T).sum(dim=1) / tokens_B.clamp(min=1.0)
    loss = -per_sequence_B.mean()

    with torch.no_grad():
        total = mask_B_T.sum().clamp(min=1.0)
        outside_B_T = ((ratio_B_T < 1.0 - clip_epsilon) | (ratio_B_T > 1.0 + clip_epsilon)).to(
            mask_B_T.dtype
        )
        stats = GrpoStats(
            clip_fraction=float((outside_B_T * mask_B_T).sum() / total),
            ratio_mean=float((ratio_B_T * mask_B_T).sum() / total),
        )
    return loss, stats
