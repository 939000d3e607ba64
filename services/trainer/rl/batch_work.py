"""What an update needs to know about a batch before its first gradient step: advantages,
and (when asked) the reference policy's logprobs, the critic's values and the returns.

Computed once per batch, over micro-batches without gradient; every tensor is ``[B, T]``
aligned with ``collate(episodes)`` (a micro-batch of rows ``idx`` and width ``t`` reads
``tensor[idx, :t]``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from opentinker.services.trainer.losses.kl import KlEstimator, kl_reward_penalty
from opentinker.services.trainer.losses.policy_gradient import Normalization
from opentinker.services.trainer.model.forward import can_share_prompts, policy_forward
from opentinker.services.trainer.model.microbatch import group_by_token_budget
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.model.shared_prompts import (
    PromptGroups,
    prompt_groups,
    shared_prompt_hidden,
)
from opentinker.services.trainer.rl.advantages import gae_token_advantages, token_advantages
from opentinker.services.trainer.rl.batch import Episode, SequenceBatch, collate
from opentinker.services.trainer.rl.critic import Critic
from opentinker.services.trainer.rl.reference import ReferencePolicy
from opentinker.spec import RlConfig


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
    old_logprobs: Literal["rollout", "trainer"] = "rollout"  # the ratio's old policy
    tis_cap: float = 2.0  # truncated importance weights with trainer old logprobs; 0 = none

    @property
    def kl_in_loss(self) -> bool:
        return self.kl_coef > 0 and not self.kl_in_reward

    def optimizer_steps(self, sequences: int) -> int:
        """Optimizer steps one batch of ``sequences`` takes (epochs x minibatches)."""
        return self.ppo_epochs * math.ceil(sequences / (self.minibatch_size or sequences))

    @classmethod
    def from_rl(cls, rl: RlConfig, *, policy_dtype: torch.dtype = torch.float32) -> UpdateConfig:
        """``rl``'s algorithm; old_logprobs "auto" resolves by the policy's dtype: the
        trainer's own where it is not float32 (bf16 on GPU: the rollout's kernels differ)."""
        old = rl.old_logprobs
        if old == "auto":
            old = "rollout" if policy_dtype == torch.float32 else "trainer"
        return cls(
            old_logprobs=old,
            tis_cap=rl.tis_cap,
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
    ``old_values_B_T``, ``returns_B_T``: critic values before the update and GAE returns (ppo);
    ``old_B_T``: the policy's own logprobs before the update (trainer old logprobs, when the
    batch takes several optimizer steps; with one, its forward pass gives them)."""

    episodes: list[Episode]
    full: SequenceBatch
    advantages_B_T: torch.Tensor
    ref_B_T: torch.Tensor | None = None
    old_values_B_T: torch.Tensor | None = None
    returns_B_T: torch.Tensor | None = None
    old_B_T: torch.Tensor | None = None


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
    old_B_T = _trainer_old_logprobs(policy, episodes, full, config)
    penalty_B_T = _kl_penalty(full, old_B_T, ref_B_T, config)
    if config.loss != "ppo":
        shift_B = None if penalty_B_T is None else penalty_B_T.sum(dim=1)
        advantages_B_T = token_advantages(
            episodes,
            mask_B_T.shape[1],
            loss=config.loss,
            gamma=config.gamma,
            reward_shift_B=shift_B,
        )
        return BatchWork(episodes, full, advantages_B_T * mask_B_T, ref_B_T, old_B_T=old_B_T)
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
    return BatchWork(
        episodes, full, advantages_B_T, ref_B_T, values_B_T * mask_B_T, returns_B_T, old_B_T
    )


def _kl_penalty(
    full: SequenceBatch,
    old_B_T: torch.Tensor | None,
    ref_B_T: torch.Tensor | None,
    config: UpdateConfig,
) -> torch.Tensor | None:
    """The per-token KL penalty of a KL in the reward (None otherwise), measured from the old
    policy: the trainer's own logprobs when they were computed, else the rollout's."""
    if not config.kl_in_reward or ref_B_T is None:
        return None
    return kl_reward_penalty(
        full.old_logprobs_B_T if old_B_T is None else old_B_T,
        ref_B_T,
        full.loss_mask_B_T,
        coef=config.kl_coef,
        estimator=config.kl_estimator,
    )


def _trainer_old_logprobs(
    policy: Policy, episodes: list[Episode], full: SequenceBatch, config: UpdateConfig
) -> torch.Tensor | None:
    """The policy's logprobs before the update, when the ratio's old policy is the trainer's
    and something reads them before the first step's forward pass gives them: a batch of
    several optimizer steps (later steps see an updated policy) or a KL in the reward."""
    if config.old_logprobs != "trainer":
        return None
    if config.optimizer_steps(len(episodes)) == 1 and not config.kl_in_reward:
        return None
    return _per_micro_batch(
        episodes,
        full,
        config,
        policy.pad_id,
        lambda sub, groups: _policy_logprobs(policy, sub, groups, config.temperature),
    )


@torch.no_grad()
def _policy_logprobs(
    policy: Policy, sub: SequenceBatch, groups: PromptGroups | None, temperature: float
) -> torch.Tensor:
    """The policy's logprobs at ``sub``'s loss positions by the update's own forward pass."""
    wanted_B_T = sub.loss_mask_B_T.to(policy.device) > 0
    out = policy_forward(
        policy, sub, temperature=temperature, hidden=False, groups=groups, wanted_B_T=wanted_B_T
    )
    return out.logprobs_B_T


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
