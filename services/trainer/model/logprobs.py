"""Token logprobs and entropies without ever holding the logits of a whole batch.

The plain way runs the causal LM to logits ``[B, L, V]`` and a float32 log_softmax over all
of them at once: for 128 sequences of 2k tokens and Qwen's 152k vocabulary that is ~160 GB,
before the backward pass doubles it. Here the transformer body runs to hidden states
``[B, L, H]`` (H is ~1-8k, not 152k), and the output head, log_softmax, target gather and
entropy run on one chunk of positions at a time. A custom autograd function keeps nothing of
a chunk but its inputs, so the backward pass recomputes a chunk's logits when it reaches it
and never holds more than one chunk's ``[chunk, V]`` (twice) either.

Works for a plain Hugging Face causal LM and for one wrapped by peft (LoRA layers live inside
the body and, when targeted, inside the head; both are called as modules here).
"""

from __future__ import annotations

import torch
from torch import nn

# Elements of one float32 [chunk, V] block: 2**26 = 256 MiB. A chunk's forward and backward
# each hold at most two such blocks, whatever the batch size.
LOGIT_CHUNK_ELEMENTS = 2**26


def chunk_positions_for(vocab_size: int, elements: int = LOGIT_CHUNK_ELEMENTS) -> int:
    """How many positions fit one ``[chunk, V]`` block of ``elements`` (at least one)."""
    return max(1, elements // vocab_size)


def causal_lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The (body, output head) of a Hugging Face causal LM, peft-wrapped or not.

    The body maps ``input_ids`` to the final (normalized) hidden states; the head maps them to
    logits. Raises ValueError for a model that does not expose both the standard way.
    """
    get_base_model = getattr(model, "get_base_model", None)
    inner = get_base_model() if get_base_model is not None else model
    get_decoder = getattr(inner, "get_decoder", None)
    body = get_decoder() if get_decoder is not None else None
    get_output_embeddings = getattr(inner, "get_output_embeddings", None)
    head = get_output_embeddings() if get_output_embeddings is not None else None
    if body is None or head is None:
        raise ValueError(
            f"{type(inner).__name__} does not expose get_decoder() and "
            "get_output_embeddings(); chunked logprobs need a Hugging Face causal LM"
        )
    return body, head


def hidden_states(
    model: nn.Module,
    tokens_B_L: torch.Tensor,
    attention_B_L: torch.Tensor | None,
    *,
    position_ids_B_L: torch.Tensor | None = None,
) -> torch.Tensor:
    """The final hidden states ``[B, L, H]`` of the causal LM's body (what its head reads).

    ``attention_B_L`` None with ``position_ids_B_L``: packed sequences, attention kept within
    each (positions restart at every packed conversation)."""
    body, _ = causal_lm_parts(model)
    out = body(
        input_ids=tokens_B_L,
        attention_mask=attention_B_L,
        position_ids=position_ids_B_L,
        use_cache=False,
    )
    return out.last_hidden_state


def _head_logits(head: nn.Module, hidden_N_H: torch.Tensor, softcap: float | None) -> torch.Tensor:
    logits_N_V = head(hidden_N_H)
    if softcap:  # Gemma-style final logit soft-capping, as the model's own forward applies
        logits_N_V = torch.tanh(logits_N_V / softcap) * softcap
    return logits_N_V


class _ChunkLogprobs(torch.autograd.Function):
    """One chunk of N positions: the logprob of each target and the entropy, both
    differentiable.

    Forward keeps only the chunk's hidden states, targets, log-normalizers and entropies
    ``[N]``; backward recomputes the chunk's logits once and turns them into their gradient.
    With s = logits / temperature, p = softmax(s), log p = s - lse:
      d logp_target / d s = onehot(target) - p
      d H / d s           = -p * (log p + H)          (H = -sum p log p)
    so grad_s = g_lp * (onehot - p) - g_H * p * (log p + H). Without an entropy gradient (the
    usual case: the entropy is only a metric) a chunk holds at most two ``[N, V]`` blocks; with
    one (an entropy bonus), three. The head's parameters come in as inputs so their gradients
    are returned through autograd like any other (LoRA on the head, a head tied to the
    embeddings).
    """

    @staticmethod
    def forward(ctx, hidden_N_H, targets_N, head, temperature, softcap, *head_params):
        with torch.no_grad():
            scaled_N_V = _head_logits(head, hidden_N_H, softcap).float().div_(temperature)
            lse_N = torch.logsumexp(scaled_N_V, dim=-1)
            logprobs_N = scaled_N_V.gather(-1, targets_N[:, None]).squeeze(-1) - lse_N
            # H = lse - sum_v p_v * s_v, with p = exp(s - lse)
            weighted_N_V = scaled_N_V.sub(lse_N[:, None]).exp_().mul_(scaled_N_V)
            entropy_N = lse_N - weighted_N_V.sum(-1)
        ctx.save_for_backward(hidden_N_H, targets_N, lse_N, entropy_N)
        ctx.head, ctx.temperature, ctx.softcap = head, temperature, softcap
        ctx.set_materialize_grads(False)  # an unused entropy's gradient arrives as None
        return logprobs_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logprobs_N, grad_entropy_N):
        hidden_N_H, targets_N, lse_N, entropy_N = ctx.saved_tensors
        params = tuple(ctx.head.parameters())
        wanted = [ctx.needs_input_grad[0]] + list(ctx.needs_input_grad[5:])
        with torch.enable_grad():
            hidden = hidden_N_H.detach().requires_grad_(wanted[0])
            logits_N_V = _head_logits(ctx.head, hidden, ctx.softcap)
        with torch.no_grad():
            grad_N_V = _scaled_logit_grad(
                logits_N_V,
                targets_N,
                lse_N,
                entropy_N,
                grad_logprobs_N,
                grad_entropy_N,
                ctx.temperature,
            )
        inputs = [t for t, want in zip((hidden, *params), wanted, strict=True) if want]
        grads = iter(torch.autograd.grad(logits_N_V, inputs, grad_N_V.to(logits_N_V.dtype)))
        grad_hidden = next(grads) if wanted[0] else None
        grad_params = [next(grads) if want else None for want in wanted[1:]]
        return grad_hidden, None, None, None, None, *grad_params


def _scaled_logit_grad(
    logits_N_V: torch.Tensor,
    targets_N: torch.Tensor,
    lse_N: torch.Tensor,
    entropy_N: torch.Tensor,
    grad_logprobs_N: torch.Tensor | None,
    grad_entropy_N: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """d(loss)/d(logits) of one chunk (see _ChunkLogprobs), float32, built in place."""
    n = logits_N_V.shape[0]
    g_lp_N_1 = (
        grad_logprobs_N.float()[:, None]
        if grad_logprobs_N is not None
        else logits_N_V.new_zeros((n, 1), dtype=torch.float32)
    )
    logp_N_V = logits_N_V.detach().to(torch.float32, copy=True).div_(temperature)
    logp_N_V.sub_(lse_N[:, None])
    if grad_entropy_N is None:
        grad_N_V = logp_N_V.exp_().mul_(-g_lp_N_1)  # -p * g_lp
    else:
        p_N_V = logp_N_V.exp()
        g_h_N_1 = grad_entropy_N.float()[:, None]
        # -p * (g_lp + g_H * (log p + H))
        grad_N_V = logp_N_V.add_(entropy_N[:, None]).mul_(g_h_N_1).add_(g_lp_N_1).mul_(p_N_V)
        grad_N_V.neg_()
        del p_N_V
    grad_N_V.scatter_add_(-1, targets_N[:, None], g_lp_N_1)  # + onehot * g_lp
    return grad_N_V.div_(temperature)


def target_logprobs_and_entropy(
    logits_V: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / temperature) at each target, and the entropy of that
    distribution, both with gradient, in float32. ``logits_V``: ``[..., V]``; ``targets``:
    ``[...]``."""
    logp_V = torch.log_softmax(logits_V.float() / temperature, dim=-1)
    logprobs = logp_V.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
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
    targets_B_T: torch.Tensor | None = None,
    wanted_B_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logprobs ``[B, T]`` and entropies ``[B, T]``, both differentiable.

    ``T = L - 1``; position t holds log p(token t+1 | tokens 0..t) (or of ``targets_B_T[t]``
    when given: any token, as Tinker's target_tokens) under
    softmax(head(hidden) / temperature). The positions are cut into chunks of
    ``chunk_positions`` (default: ``chunk_positions_for(V)``); the backward pass recomputes
    one chunk's logits at a time.

    wanted_B_T: where the caller reads the result (a loss mask's nonzero positions): the head
    then runs there only, and every other position holds 0. A loss that ignores prompts, env
    replies and padding thus pays the head (for Qwen2.5-0.5B's shapes, about a third of the
    training multiply-adds per position) only on the tokens it trains.
    """
    if chunk_positions is not None and chunk_positions < 1:
        raise ValueError(f"chunk_positions must be >= 1, got {chunk_positions}")
    size, length, width = hidden_B_L_H.shape
    hidden_N_H = hidden_B_L_H[:, :-1].reshape(-1, width)
    targets_N = (tokens_B_L[:, 1:] if targets_B_T is None else targets_B_T).reshape(-1)
    where_M, nothing = None, False
    if wanted_B_T is not None:
        where_M = wanted_B_T.reshape(-1).nonzero().squeeze(-1)
        nothing = where_M.numel() == 0
        if nothing:  # one position, times 0 below, keeps the loss connected to the graph
            where_M = where_M.new_zeros(1)
        hidden_N_H = hidden_N_H.index_select(0, where_M.to(hidden_N_H.device))
        targets_N = targets_N.index_select(0, where_M.to(targets_N.device))
    chunk = chunk_positions or chunk_positions_for(_vocab_size(head))
    params = tuple(head.parameters())
    logprobs, entropies = [], []
    for start in range(0, hidden_N_H.shape[0], chunk):
        lp, ent = _ChunkLogprobs.apply(
            hidden_N_H[start : start + chunk],
            targets_N[start : start + chunk],
            head,
            temperature,
            softcap,
            *params,
        )
        logprobs.append(lp)
        entropies.append(ent)
    logprobs_N, entropies_N = torch.cat(logprobs), torch.cat(entropies)
    if nothing:
        logprobs_N, entropies_N = logprobs_N * 0.0, entropies_N * 0.0
    if where_M is not None:
        logprobs_N = _at_positions(logprobs_N, where_M, size * (length - 1))
        entropies_N = _at_positions(entropies_N, where_M, size * (length - 1))
    shape = (size, length - 1)
    return logprobs_N.view(shape), entropies_N.view(shape)


def _at_positions(values_M: torch.Tensor, where_M: torch.Tensor, count: int) -> torch.Tensor:
    """``[count]`` zeros holding ``values_M`` at ``where_M`` (differentiable in the values)."""
    return values_M.new_zeros(count).index_put((where_M.to(values_M.device),), values_M)


def token_logprobs_and_entropy(
    model: nn.Module,
    tokens_B_L: torch.Tensor,
    attention_B_L: torch.Tensor | None,
    *,
    temperature: float = 1.0,
    chunk_positions: int | None = None,
    position_ids_B_L: torch.Tensor | None = None,
    wanted_B_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal LM's next-token logprobs and entropies ``[B, L - 1]``, chunked (see module);
    only at ``wanted_B_T`` when given (0 elsewhere)."""
    _, head = causal_lm_parts(model)
    hidden_B_L_H = hidden_states(
        model, tokens_B_L, attention_B_L, position_ids_B_L=position_ids_B_L
    )
    return logprobs_from_hidden(
        head,
        hidden_B_L_H,
        tokens_B_L,
        temperature=temperature,
        chunk_positions=chunk_positions,
        softcap=logit_softcap(model),
        wanted_B_T=wanted_B_T,
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
        # peft's method; nn.Module.__getattr__ is typed as returning Tensor | Module.
        weight = head.get_base_layer().weight  # type: ignore[operator]
    return int(weight.shape[0])
