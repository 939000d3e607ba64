"""What an update needs to know about a batch before its first gradient step: advantages,
and (when asked) the reference policy's logprobs, the critic's values and the returns.

Computed once per batch, over micro-batches without gradient; every tensor is ``[B, T]``
aligned with ``collate(episodes)`` (a micro-batch of rows ``idx`` and width ``t`` reads
``tensor[idx, :t]``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from opentinker.spec import RlConfig

from .advantages import gae_token_advantages, token_advantages
from .batch import Episode, SequenceBatch, collate
from .critic import Critic
from .forward import can_share_prompts
from .losses.kl import KlEstimator, kl_reward_penalty
from .losses.policy_gradient import Normalization
from .microbatch import group_by_token_budget
from .policy import Policy
from .reference import ReferencePolicy
from .shared_prompts import PromptGroups, prompt_groups, shared_prompt_hidden


@dataclass(frozen=True)
class UpdateConfig:
    """How one batch is turned into optimizer steps (RlConfig's algorithm fields; the
    defaults are one GRPO step per batch with sequence normalization)."""

    clip_epsilon: float = 0.2
    temperature: float = 1.0
    loss: Literal["grpo", "ppo", "rloo", "reinforce"] = "grpo"
    normalization: Normalization = "sequence"
    max_completion_tokens: int = 0  # constant of "constant" normalization
    ppo_epochs: int = 1
    minibatch_size: int = 0  # sequences per optimizer step; 0 = the whole batch
    micro_batch_tokens: int = 0  # padded tokens per forward pass; 0 = the whole minibatch
    max_padding: float = 0.25  # a forward pass's share of padding at most (microbatch.py)
    kl_coef: float = 0.0
    kl_estimator: KlEstimator = "k3"
    kl_in_reward: bool = False
    entropy_coef: float = 0.0
    max_grad_norm: float = 1.0  # 0 = no clip
    gamma: float = 1.0
    gae_lambda: float = 0.95

    @property
    def kl_in_loss(self) -> bool:
        return self.kl_coef > 0 and not self.kl_in_reward

    @classmethod
    def from_rl(cls, rl: RlConfig) -> UpdateConfig:
        return cls(
            clip_epsilon=rl.clip_epsilon,
            temperature=rl.sampling.temperature,
            loss=rl.loss,
            normalization=rl.loss_normalization,
            max_completion_tokens=rl.max_completion_tokens,
            ppo_epochs=rl.ppo_epochs,
            minibatch_size=rl.minibatch_size,
            micro_batch_tokens=rl.micro_batch_tokens,
            max_padding=rl.max_padding_fraction,
            kl_coef=rl.kl_coef,
            kl_estimator=rl.kl_estimator,
            kl_in_reward=rl.kl_in_reward,
            entropy_coef=rl.entropy_coef,
            max_grad_norm=rl.max_grad_norm,
            gamma=rl.gamma,
            gae_lambda=rl.gae_lambda,
        )


@dataclass(frozen=True)
class BatchWork:
    """The constants of one batch's update. ``ref_B_T``: reference logprobs (KL on);
    ``old_values_B_T``, ``returns_B_T``: critic values before the update and GAE returns (ppo)."""

    episodes: list[Episode]
    full: SequenceBatch
    advantages_B_T: torch.Tensor
    ref_B_T: torch.Tensor | None = None
    old_values_B_T: torch.Tensor | None = None
    returns_B_T: torch.Tensor | None = None


def prepare(
    policy: Policy,
    episodes: list[Episode],
    config: UpdateConfig,
    *,
    reference: ReferencePolicy | None,
    critic: Critic | None,
) -> BatchWork:
    full = collate(episodes, policy.pad_id)
    mask_B_T = full.loss_mask_B_T
    ref_B_T = None
    if config.kl_coef > 0 and reference is None:
        raise ValueError("kl_coef > 0 needs a reference policy")
    if reference is not None:  # also with kl_coef 0: the KL is then measured, not optimized
        ref_B_T = _per_micro_batch(
            episodes,
            full,
            config,
            policy.pad_id,
            lambda sub, groups: reference.logprobs(
                sub, temperature=config.temperature, groups=groups
            ),
        )
    penalty_B_T = None
    if config.kl_in_reward and ref_B_T is not None:
        penalty_B_T = kl_reward_penalty(
            full.old_logprobs_B_T,
            ref_B_T,
            mask_B_T,
            coef=config.kl_coef,
            estimator=config.kl_estimator,
        )
    if config.loss != "ppo":
        shift_B = None if penalty_B_T is None else penalty_B_T.sum(dim=1)
        advantages_B_T = token_advantages(
            episodes,
            mask_B_T.shape[1],
            loss=config.loss,
            gamma=config.gamma,
            reward_shift_B=shift_B,
        )
        return BatchWork(episodes, full, advantages_B_T * mask_B_T, ref_B_T)
    if critic is None:
        raise ValueError("loss 'ppo' needs a critic")
    values_B_T = _per_micro_batch(
        episodes,
        full,
        config,
        policy.pad_id,
        lambda sub, groups: _values(policy, critic, sub, groups),
    )
    advantages_B_T, returns_B_T = gae_token_advantages(
        episodes,
        values_B_T,
        mask_B_T,
        gamma=config.gamma,
        lam=config.gae_lambda,
        reward_shift_B_T=penalty_B_T,
    )
    return BatchWork(episodes, full, advantages_B_T, ref_B_T, values_B_T * mask_B_T, returns_B_T)


@torch.no_grad()
def _values(
    policy: Policy, critic: Critic, sub: SequenceBatch, groups: PromptGroups | None
) -> torch.Tensor:
    """The critic's values ``[B, T]`` (read from the hidden state at each position t); with
    ``groups``, each prompt runs once and positions before a row's last prompt token (where
    its loss mask is 0) read a hidden state of 0."""
    if groups is not None and can_share_prompts(policy, sub):
        hidden_B_T_H = shared_prompt_hidden(policy.model, sub, groups, device=policy.device)
    else:
        hidden_B_T_H = policy.hidden_states(sub)[:, :-1]
    return critic.values(hidden_B_T_H.float()).cpu()


def _per_micro_batch(
    episodes: list[Episode],
    full: SequenceBatch,
    config: UpdateConfig,
    pad_id: int,
    compute: Callable[[SequenceBatch, PromptGroups | None], torch.Tensor],
) -> torch.Tensor:
    """``compute`` over the update's micro-batches (``config``'s token budget and padding
    share; each with its rows' prompt groups), assembled to ``[B, T]``."""
    out_B_T = torch.zeros_like(full.loss_mask_B_T)
    lengths = [len(e.token_ids) for e in episodes]
    for idx in group_by_token_budget(lengths, config.micro_batch_tokens, config.max_padding):
        chosen = [episodes[i] for i in idx]
        sub = collate(chosen, pad_id)
        part = compute(sub, prompt_groups(chosen)).detach().float().cpu()
        out_B_T[idx, : part.shape[1]] = part
    return out_B_T
