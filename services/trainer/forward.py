"""The policy's forward pass as the update needs it: logprobs, entropy, last hidden states.

When neither the entropy's gradient (entropy bonus) nor the hidden states (critic) are needed,
this is ``Policy.token_logprobs_and_entropy`` (the memory-lean path). Otherwise the model runs
with ``output_hidden_states=True`` here and the [B, T, V] log-softmax is formed once.
TODO(lead): once Policy exposes hidden states and chunked entropy, route both through it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from .batch import SequenceBatch
from .losses.entropy import entropy_from_logprobs
from .policy import Policy


@dataclass(frozen=True)
class ForwardOut:
    """logprobs_B_T: log p(token t+1 | ..t) with gradient. entropy_B_T: of the distribution at
    t (with gradient only when asked). hidden_B_T_H: the last layer's hidden state at t (the
    state the value of position t is read from), or None."""

    logprobs_B_T: torch.Tensor
    entropy_B_T: torch.Tensor
    hidden_B_T_H: torch.Tensor | None


def policy_forward(
    policy: Policy,
    batch: SequenceBatch,
    *,
    temperature: float,
    entropy_grad: bool = False,
    hidden: bool = False,
) -> ForwardOut:
    if not entropy_grad and not hidden:
        logprobs_B_T, entropy_B_T = policy.token_logprobs_and_entropy(
            batch, temperature=temperature
        )
        return ForwardOut(logprobs_B_T, entropy_B_T, None)
    return model_forward(
        policy.model, batch, temperature=temperature, device=policy.device, hidden=hidden
    )


def model_forward(
    model: PreTrainedModel,
    batch: SequenceBatch,
    *,
    temperature: float,
    device: torch.device,
    hidden: bool = False,
) -> ForwardOut:
    """Logprobs and entropy (both with gradient) of any causal LM, and its hidden states."""
    tokens_B_L = batch.tokens_B_L.to(device)
    out = model(
        input_ids=tokens_B_L,
        attention_mask=batch.attention_mask_B_L.to(device),
        output_hidden_states=hidden,
    )
    logp_B_T_V = torch.log_softmax(out.logits[:, :-1].float() / temperature, dim=-1)
    logprobs_B_T = logp_B_T_V.gather(-1, tokens_B_L[:, 1:].unsqueeze(-1)).squeeze(-1)
    hidden_B_T_H = out.hidden_states[-1][:, :-1].float() if hidden else None
    return ForwardOut(logprobs_B_T, entropy_from_logprobs(logp_B_T_V), hidden_B_T_H)
