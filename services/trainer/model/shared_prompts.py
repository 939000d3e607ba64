"""The policy's logprobs with each prompt of a GRPO group run once, forward and backward.

The n samples of a prompt begin with it token for token, and the plain forward runs it n
times (and its backward n times). Here every distinct prompt but its last token runs once into
a KV cache, with gradient; the cache is repeated to one row per sample, and each row runs only
its last prompt token and its completion on top of it. The backward pass sums each row's
gradient through the repeat back into its prompt, which is the plain forward's gradient to
float rounding (tests/trainer/test_shared_prompts.py). The demo's batch (16 prompts x 8 samples, 30
prompt tokens, one answer token) on the tiny model: forward + backward 113 -> 28 ms
(bench/shared_prompts.py).

Only positions from the last prompt token on are computed: the logprobs and entropies of
earlier positions are 0, where the RL loss mask is 0 anyway. The prompts run right-padded, so
no query row is all padding.

Gradient checkpointing recomputes each layer in the backward pass, and transformers drops a KV
cache from a checkpointed layer unless the layer only reads it (``_can_checkpoint_with_cache``):
a cache that appends would be appended to again by the recomputation. So the caches here have
no such side effect: the prompt pass's layer sets its keys and values (a recomputation sets the
same), and the rows' layer reads the prompt's, repeated to the rows, and stores nothing. Models
with sliding-window layers keep the plain forward (their cache layers keep a window).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicLayer,
    LinearAttentionCacheLayerMixin,
)
from transformers.modeling_layers import GradientCheckpointingLayer

from opentinker.services.trainer.model.logprobs import (
    causal_lm_parts,
    logit_softcap,
    logprobs_from_hidden,
)
from opentinker.services.trainer.rl.batch import Episode, SequenceBatch


@dataclass(frozen=True)
class PromptGroups:
    """Which rows of a batch begin with the same prompt.

    prompt_lengths: each row's prompt length (tokens). distinct_rows: one row per distinct
    prompt (the first row that has it). slot_of_row: each row's index into distinct_rows.
    """

    prompt_lengths: tuple[int, ...]
    distinct_rows: tuple[int, ...]
    slot_of_row: tuple[int, ...]


def prompt_groups(episodes: Sequence[Episode]) -> PromptGroups | None:
    """The episodes' prompt groups; None when no two share a prompt or a prompt has fewer than
    2 tokens (nothing before its last token to share)."""
    if not episodes or min(e.prompt_length for e in episodes) < 2:
        return None
    slots: dict[tuple[int, ...], int] = {}
    distinct: list[int] = []
    slot_of_row = []
    for row, episode in enumerate(episodes):
        prompt = tuple(episode.token_ids[: episode.prompt_length])
        if prompt not in slots:
            slots[prompt] = len(distinct)
            distinct.append(row)
        slot_of_row.append(slots[prompt])
    if len(distinct) == len(episodes):
        return None
    return PromptGroups(
        tuple(e.prompt_length for e in episodes), tuple(distinct), tuple(slot_of_row)
    )


def shared_prompt_logprobs(
    model: nn.Module,
    batch: SequenceBatch,
    groups: PromptGroups,
    *,
    temperature: float,
    device: torch.device,
    chunk_positions: int | None = None,
    hidden: bool = False,
    wanted_B_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Next-token logprobs and entropies ``[B, T]`` of ``batch`` (as ``logprobs_from_hidden``
    gives them) from the last prompt token on; 0 before it (and, given ``wanted_B_T``, 0
    wherever it is 0). Differentiable. ``hidden``: also the last layer's hidden states
    ``[B, T, H]`` (a critic's input), 0 before it."""
    _, head = causal_lm_parts(model)
    hidden_B_S_H, suffix_B_S, prompt_B = _rows_hidden(model, batch, groups, device)
    positions = batch.tokens_B_L.shape[1] - 1
    logprobs_B_J, entropy_B_J = logprobs_from_hidden(
        head,
        hidden_B_S_H,
        suffix_B_S,
        temperature=temperature,
        chunk_positions=chunk_positions,
        softcap=logit_softcap(model),
        wanted_B_T=None
        if wanted_B_T is None
        else _from_batch_positions(wanted_B_T.to(device), prompt_B, suffix_B_S.shape[1] - 1),
    )
    return (
        _at_batch_positions(logprobs_B_J, prompt_B, positions),
        _at_batch_positions(entropy_B_J, prompt_B, positions),
        _at_batch_positions(hidden_B_S_H, prompt_B, positions) if hidden else None,
    )


def shared_prompt_hidden(
    model: nn.Module, batch: SequenceBatch, groups: PromptGroups, *, device: torch.device
) -> torch.Tensor:
    """The last layer's hidden states ``[B, T, H]`` (position t: before token t + 1) from the
    last prompt token on; 0 before it (a critic's values, without the logprobs)."""
    hidden_B_S_H, _, prompt_B = _rows_hidden(model, batch, groups, device)
    return _at_batch_positions(hidden_B_S_H, prompt_B, batch.tokens_B_L.shape[1] - 1)


def _rows_hidden(
    model: nn.Module, batch: SequenceBatch, groups: PromptGroups, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's hidden states ``[B, S, H]`` from its last prompt token to its end (right-
    padded), those tokens ``[B, S]``, and the rows' prompt lengths ``[B]``."""
    body, _ = causal_lm_parts(model)
    tokens_B_L = batch.tokens_B_L.to(device)
    lengths_B = batch.attention_mask_B_L.sum(dim=1).to(device)
    prompt_B = torch.tensor(groups.prompt_lengths, device=device)
    slot_B = torch.tensor(groups.slot_of_row, device=device)
    # The distinct prompts but their last token, right-padded, into the cache.
    prefix_U = prompt_B[list(groups.distinct_rows)] - 1
    width = int(prefix_U.max())
    positions_U_W = torch.arange(width, device=device).expand(len(prefix_U), -1)
    prefix_mask_U_W = (positions_U_W < prefix_U[:, None]).long()
    prefix_ids_U_W = tokens_B_L[list(groups.distinct_rows), :width] * prefix_mask_U_W
    prompts = Cache(layer_class_to_replicate=_PromptLayer)
    with _layers_read_caches(body):
        body(
            input_ids=prefix_ids_U_W,
            attention_mask=prefix_mask_U_W,
            position_ids=positions_U_W,
            past_key_values=prompts,
            use_cache=False,  # the layers fill the cache passed in; none to make or return
        )
    # One row per sample; the backward sums the rows' gradients back into their prompt.
    rows: list[CacheLayerMixin | LinearAttentionCacheLayerMixin] = []
    for layer in prompts.layers:
        assert isinstance(layer, _PromptLayer)  # layer_class_to_replicate above
        rows.append(_RowsLayer(layer, slot_B))
    cache = Cache(layers=rows)
    # Each row from its last prompt token to its end, right-padded, on top of its prompt.
    span = int((lengths_B - prompt_B).max()) + 1
    positions_B_S = (prompt_B - 1)[:, None] + torch.arange(span, device=device)
    suffix_mask_B_S = (positions_B_S < lengths_B[:, None]).long()
    last = tokens_B_L.shape[1] - 1
    suffix_B_S = tokens_B_L.gather(1, positions_B_S.clamp(max=last)) * suffix_mask_B_S
    with _layers_read_caches(body):
        hidden_B_S_H = body(
            input_ids=suffix_B_S,
            attention_mask=torch.cat([prefix_mask_U_W[slot_B], suffix_mask_B_S], dim=1),
            position_ids=positions_B_S,
            past_key_values=cache,
            use_cache=False,
        ).last_hidden_state
    return hidden_B_S_H, suffix_B_S, prompt_B


def _from_batch_positions(
    values_B_T: torch.Tensor, prompt_B: torch.Tensor, span: int
) -> torch.Tensor:
    """``[B, span]``: row b's value at batch position prompt_b - 1 + j, as its j-th (the
    inverse of ``_at_batch_positions``); 0 past the batch's positions."""
    index_B_J = (prompt_B - 1)[:, None] + torch.arange(span, device=values_B_T.device)
    inside_B_J = index_B_J < values_B_T.shape[1]
    last = values_B_T.shape[1] - 1
    return values_B_T.gather(1, index_B_J.clamp(max=last)) * inside_B_J


def _at_batch_positions(
    values_B_J: torch.Tensor, prompt_B: torch.Tensor, positions: int
) -> torch.Tensor:
    """``[B, positions, ...]``: row b's value j (a number, or a vector) moved to position
    prompt_b - 1 + j (the batch's next-token position of that target); positions past the end
    are padding and dropped."""
    size, span = values_B_J.shape[:2]
    index_B_J = (prompt_B - 1)[:, None] + torch.arange(span, device=values_B_J.device)
    trailing = values_B_J.shape[2:]
    index = index_B_J.view(size, span, *([1] * len(trailing))).expand_as(values_B_J)
    wide = values_B_J.new_zeros(size, positions + span, *trailing)
    return wide.scatter(1, index, values_B_J)[:, :positions]


class _PromptLayer(DynamicLayer):
    """The prompt pass's cache layer: ``update`` sets the keys and values rather than appending
    them, so a checkpointed layer's recomputation sets the same tensors again."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = key_states, value_states
        return key_states, value_states


class _RowsLayer(DynamicLayer):
    """The rows' pass: each row's prompt keys and values (``prompt`` at ``slot_B``) before its
    own; nothing is stored, so a recomputation reads the same. The repeat is made per call and
    not kept: under checkpointing only the prompts' ``[U, ...]`` tensors stay alive."""

    def __init__(self, prompt: DynamicLayer, slot_B: torch.Tensor) -> None:
        super().__init__()
        keys_U, values_U = prompt.keys, prompt.values
        assert keys_U is not None and values_U is not None  # the prompts' pass filled them
        self.lazy_initialization(keys_U, values_U)
        self.keys, self.values, self._slot_B = keys_U, values_U, slot_B
        self._keys_U, self._values_U = keys_U, values_U  # the same tensors, typed as set

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.cat([self._keys_U[self._slot_B], key_states], dim=-2),
            torch.cat([self._values_U[self._slot_B], value_states], dim=-2),
        )


@contextlib.contextmanager
def _layers_read_caches(body: nn.Module) -> Iterator[None]:
    """Let checkpointed layers keep the caches above (transformers drops a cache from a
    checkpointed layer unless the layer says it only reads it; ours have no side effect a
    recomputation could repeat)."""
    layers = [m for m in body.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache  # back to the class's False
