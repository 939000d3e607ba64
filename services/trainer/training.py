"""One GRPO update of a Policy on a batch of episodes (shared by the service loop and benches)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from .batch import Episode, collate
from .estimators.grpo import group_advantages
from .losses.policy_gradient import grpo_loss
from .policy import Policy

MAX_GRAD_NORM = 1.0


@dataclass(frozen=True)
class TrainStats:
    """Figures of one update. entropy: mean over trained tokens (nats). logprob_gap: mean
    |trainer logprob - sampling logprob| over trained tokens before the update (0 when the
    rollout samples from exactly the trainer's weights)."""

    loss: float
    entropy: float
    clip_fraction: float
    ratio_mean: float
    grad_norm: float
    logprob_gap: float
    sequences: int
    trained_tokens: int


def episode_advantages(episodes: list[Episode]) -> torch.Tensor:
    """GRPO advantage of each episode within its group (same group_index), shape ``[B]``."""
    by_group: dict[int, list[int]] = defaultdict(list)
    for i, ep in enumerate(episodes):
        by_group[ep.group_index].append(i)
    advantages_B = torch.zeros(len(episodes))
    for members in by_group.values():
        rewards_1_N = torch.tensor([[episodes[i].reward for i in members]], dtype=torch.float32)
        advantages_B[members] = group_advantages(rewards_1_N)[0]
    return advantages_B


def grpo_update(
    policy: Policy,
    episodes: list[Episode],
    *,
    clip_epsilon: float,
    temperature: float,
    max_grad_norm: float = MAX_GRAD_NORM,
) -> TrainStats:
    """Forward, GRPO loss, backward, clip, AdamW step. ``episodes`` must be non-empty.

    Sequences whose advantage is exactly 0 (every member of their group got the same reward)
    add exactly 0 to the loss and its gradient, so they are left out of the forward pass; the
    loss over the rest is scaled by n_active / n_total, which keeps it (and the gradient) equal
    to the full-batch mean. Early in training, when most groups score all zeros, this skips
    most of the work. When no sequence has signal, no optimizer step is taken.
    """
    advantages_all_B = episode_advantages(episodes)
    active = [i for i in range(len(episodes)) if advantages_all_B[i] != 0]
    if not active:
        nll = [-lp for ep in episodes for lp, m in zip(ep.logprobs, ep.loss_mask, strict=True) if m]
        return TrainStats(
            loss=0.0,
            entropy=sum(nll) / max(len(nll), 1),  # sampled-token NLL: an entropy estimate
            clip_fraction=0.0,
            ratio_mean=1.0,
            grad_norm=0.0,
            logprob_gap=0.0,
            sequences=len(episodes),
            trained_tokens=0,
        )
    chosen = [episodes[i] for i in active]
    batch = collate(chosen, policy.pad_id)
    advantages_B = advantages_all_B[active]
    new_B_T, entropy_B_T = policy.token_logprobs_and_entropy(batch, temperature=temperature)
    loss, stats = grpo_loss(
        new_B_T, batch.old_logprobs_B_T, advantages_B, batch.loss_mask_B_T, clip_epsilon
    )
    loss = loss * (len(chosen) / len(episodes))
    loss.backward()
    grad_norm = policy.optimizer_step(max_grad_norm)
    mask_B_T = batch.loss_mask_B_T
    tokens = float(mask_B_T.sum().clamp(min=1.0))
    with torch.no_grad():
        gap = float(((new_B_T.detach() - batch.old_logprobs_B_T).abs() * mask_B_T).sum() / tokens)
        entropy = float((entropy_B_T * mask_B_T).sum() / tokens)
    return TrainStats(
        loss=float(loss.detach()),
        entropy=entropy,
        clip_fraction=stats.clip_fraction,
        ratio_mean=stats.ratio_mean,
        grad_norm=grad_norm,
        logprob_gap=gap,
        sequences=len(episodes),
        trained_tokens=int(mask_B_T.sum()),
    )
