"""Token logprobs and entropies without ever holding the logits of a whole batch.

The plain way runs the causal LM to logits ``[B, L, V]`` and a float32 log_softmax over all
of them at once: for 128 sequences of 2k tokens and Qwen's 152k vocabulary that is ~160 GB,
before the backward pass doubles it. Here the transformer body runs to hidden states
``[B, L, H]`` (H is ~1-8k, not 152k), and the output head, log_softmax, target gather and
entropy run on one chunk of positions at a time. Each chunk sits under activation
checkpointing, so the backward pass recomputes a chunk's logits when it reaches it and never
holds more than one chunk's ``[chunk, V]`` either.

Works for a plain Hugging Face causal LM and for one wrapped by peft (LoRA layers live inside
the body and, when targeted, inside the head; both are called as modules here).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# Elements of one float32 [chunk, V] block: 2**26 = 256 MiB. A chunk's forward and backward
# hold a few such blocks (logits, log-softmax, its gradient), whatever the batch size.
LOGIT_CHUNK_ELEMENTS = 2**26


def chunk_positions_for(vocab_size: int, elements: int = LOGIT_CHUNK_ELEMENTS) -> int:
    """How many positions fit one ``[chunk, V]`` block of ``elements`` (at least one)."""
    return max(1, elements // vocab_size)


def causal_lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The (body, output head) of a Hugging Face causal LM, peft-wrapped or not.

    The body maps ``input_ids`` to the final (normalized) hidden states; the head maps them to
    logits. Raises ValueError for a model that does not expose both the standard way.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    get_decoder = getattr(inner, "get_decoder", None)
    body = get_decoder() if get_decoder is not None else None
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if body is None or head is None:
        raise ValueError(
            f"{type(inner).__name__} does not expose get_decoder() and "
            "get_output_embeddings(); chunked logprobs need a Hugging Face causal LM"
        )
    return body, head


def hidden_states(
    model: nn.Module, tokens_B_L: torch.Tensor, attention_B_L: torch.Tensor
) -> torch.Tensor:
    """The final hidden states ``[B, L, H]`` of the causal LM's body (what its head reads)."""
    body, _ = causal_lm_parts(model)
    out = body(input_ids=tokens_B_L, attention_mask=attention_B_L, use_cache=False)
    return out.last_hidden_state


def _chunk_logprobs_and_entropy(
    head: nn.Module,
    hidden_N_H: torch.Tensor,
    targets_N: torch.Tensor,
    temperature: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logprob of each target and the entropy (no gradient) for one chunk of N positions."""
    logits_N_V = head(hidden_N_H)
    if softcap:  # Gemma-style final logit soft-capping, as the model's own forward applies
        logits_N_V = torch.tanh(logits_N_V / softcap) * softcap
    return target_logprobs_and_entropy(logits_N_V, targets_N, temperature)


def target_logprobs_and_entropy(
    logits_V: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / temperature) at each target (with gradient), and the entropy of
    that distribution (detached), in float32. ``logits_V``: ``[..., V]``; ``targets``: ``[...]``."""
    logp_V = torch.log_softmax(logits_V.float() / temperature, dim=-1)
    logprobs = logp_V.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_V.exp() * logp_V).sum(-1)
    return logprobs, entropy


def logprobs_from_hidden(
    head: nn.Module,
    hidden_B_L_H: torch.Tensor,
    tokens_B_L: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_positions: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logprobs ``[B, T]`` (with gradient) and entropies ``[B, T]`` (detached).

    ``T = L - 1``; position t holds log p(token t+1 | tokens 0..t) under
    softmax(head(hidden) / temperature). The ``B * T`` positions are cut into chunks of
    ``chunk_positions`` (default: ``chunk_positions_for(V)``), each checkpointed when
    gradients are on.
    """
    if chunk_positions is not None and chunk_positions < 1:
        raise ValueError(f"chunk_positions must be >= 1, got {chunk_positions}")
    size, length, width = hidden_B_L_H.shape
    hidden_N_H = hidden_B_L_H[:, :-1].reshape(-1, width)
    targets_N = tokens_B_L[:, 1:].reshape(-1)
    chunk = chunk_positions or chunk_positions_for(_vocab_size(head))
    logprobs, entropies = [], []
    for start in range(0, hidden_N_H.shape[0], chunk):
        args = (head, hidden_N_H[start : start + chunk], targets_N[start : start + chunk])
        if torch.is_grad_enabled():
            lp, ent = checkpoint(
                _chunk_logprobs_and_entropy, *args, temperature, softcap, use_reentrant=False
            )
        else:
            lp, ent = _chunk_logprobs_and_entropy(*args, temperature, softcap)
        logprobs.append(lp)
        entropies.append(ent)
    shape = (size, length - 1)
    return torch.cat(logprobs).view(shape), torch.cat(entropies).view(shape)


def token_logprobs_and_entropy(
    model: nn.Module,
    tokens_B_L: torch.Tensor,
    attention_B_L: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_positions: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal LM's next-token logprobs and entropies ``[B, L - 1]``, chunked (see module)."""
    _, head = causal_lm_parts(model)
    hidden_B_L_H = hidden_states(model, tokens_B_L, attention_B_L)
    return logprobs_from_hidden(
        head,
        hidden_B_L_H,
        tokens_B_L,
        temperature=temperature,
        chunk_positions=chunk_positions,
        softcap=logit_softcap(model),
    )


def unchunked_token_logprobs_and_entropy(
    model: nn.Module,
    tokens_B_L: torch.Tensor,
    attention_B_L: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain way, kept as the reference the chunked one is tested and measured against:
    the model's own forward to logits ``[B, L, V]``, one log_softmax over all of them."""
    logits_B_L_V = model(input_ids=tokens_B_L, attention_mask=attention_B_L).logits
    return target_logprobs_and_entropy(logits_B_L_V[:, :-1], tokens_B_L[:, 1:], temperature)


def logit_softcap(model: nn.Module) -> float | None:
    """The final-logit soft-capping the model's config asks for (Gemma 2), else None."""
    return getattr(getattr(model, "config", None), "final_logit_softcapping", None)


def _vocab_size(head: nn.Module) -> int:
    weight = getattr(head, "weight", None)
    if weight is None:  # e.g. a peft-wrapped head: the wrapped layer keeps the weight
        weight = head.get_base_layer().weight
    return int(weight.shape[0])
