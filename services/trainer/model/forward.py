"""The policy's forward pass as the update needs it: logprobs, entropy, last hidden states.

Every path runs the transformer body once to hidden states and the output head in chunks of
positions (logprobs.py): the logits of a whole micro-batch ``[B, T, V]`` are never held, also
when the entropy bonus needs the entropy's gradient or the critic needs the hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from opentinker.services.modeling.attention import has_full_attention_only
from opentinker.services.trainer.model.logprobs import (
    causal_lm_parts,
    hidden_states,
    logit_softcap,
    logprobs_from_hidden,
)
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.model.shared_prompts import PromptGroups, shared_prompt_logprobs
from opentinker.services.trainer.model.vision_logprobs import vision_hidden_states
from opentinker.services.trainer.rl.batch import SequenceBatch


@dataclass(frozen=True)
class ForwardOut:
    """logprobs_B_T: log p(token t+1 | ..t), entropy_B_T: of the distribution at t (both with
    gradient). hidden_B_T_H: the last layer's hidden state at t (the state the value of
    position t is read from), or None."""

    logprobs_B_T: torch.Tensor
    entropy_B_T: torch.Tensor
    hidden_B_T_H: torch.Tensor | None


def policy_forward(
    policy: Policy,
    batch: SequenceBatch,
    *,
    temperature: float,
    hidden: bool = False,
    groups: PromptGroups | None = None,
    wanted_B_T: torch.Tensor | None = None,
) -> ForwardOut:
    """The policy's logprobs and entropy for ``batch``, and its hidden states when asked.

    wanted_B_T: the positions the caller reads (its loss mask); the output head runs there
    only and the logprobs and entropies elsewhere are 0 (logprobs.logprobs_from_hidden).

    groups: rows that share a prompt (RL episodes of one group); each prompt then runs once
    (shared_prompts.py) and positions before a row's last prompt token hold 0 (hidden states
    too), where its loss mask is 0. Not with a vision-language model, sliding-window or linear
    attention layers, or sharded ranks: those take the plain forward."""
    if groups is not None and can_share_prompts(policy, batch):
        logprobs_B_T, entropy_B_T, hidden_B_T_H = shared_prompt_logprobs(
            policy.model,
            batch,
            groups,
            temperature=temperature,
            device=policy.device,
            chunk_positions=policy.logit_chunk_positions,
            hidden=hidden,
            wanted_B_T=wanted_B_T,
        )
        return ForwardOut(
            logprobs_B_T, entropy_B_T, None if hidden_B_T_H is None else hidden_B_T_H.float()
        )
    hidden_B_L_H = policy.hidden_states(batch)
    logprobs_B_T, entropy_B_T = policy.logprobs_from_hidden(
        batch, hidden_B_L_H, temperature=temperature, wanted_B_T=wanted_B_T
    )
    return ForwardOut(logprobs_B_T, entropy_B_T, hidden_B_L_H[:, :-1].float() if hidden else None)


def can_share_prompts(policy: Policy, batch: SequenceBatch) -> bool:
    """Whether ``batch`` may run with shared prompts on ``policy``'s model (or a frozen copy)."""
    return not (
        batch.images
        or policy.image_processor is not None  # vision-language: 3-D rope positions
        or policy.hidden_through_root
        or not has_full_attention_only(policy.model)
    )


def model_forward(
    model: PreTrainedModel,
    batch: SequenceBatch,
    *,
    temperature: float,
    device: torch.device,
    image_processor: Any = None,
    wanted_B_T: torch.Tensor | None = None,
) -> ForwardOut:
    """Logprobs and entropy of any causal LM (e.g. a frozen reference copy); a batch with
    images needs the vision-language model's ``image_processor``. ``wanted_B_T``: as in
    ``policy_forward``."""
    tokens_B_L = batch.tokens_B_L.to(device)
    attention_B_L = batch.attention_mask_B_L.to(device)
    if batch.images:
        hidden_B_L_H = vision_hidden_states(
            model, image_processor, tokens_B_L, attention_B_L, batch.images
        )
    else:
        hidden_B_L_H = hidden_states(model, tokens_B_L, attention_B_L)
    _, head = causal_lm_parts(model)
    logprobs_B_T, entropy_B_T = logprobs_from_hidden(
        head,
        hidden_B_L_H,
        tokens_B_L,
        temperature=temperature,
        softcap=logit_softcap(model),
        wanted_B_T=None if wanted_B_T is None else wanted_B_T.to(device),
    )
    return ForwardOut(logprobs_B_T, entropy_B_T, None)
