"""A multi-turn episode's next prompt continues from the KV cache of its previous turn.

An agent loop's prompt for turn t+1 is turn t's prompt, its completion and the env's reply,
and Hugging Face's ``generate`` computes every token of it again: over an episode the work
grows with the square of its turns. Here ``TransformersEngine`` keeps each finished row's keys
and values (its prompt and completion but the last token, whose keys were never computed),
keyed by those tokens; the completion must end with eos, so a later prompt is matched by
trying the prefixes that end at one of its eos tokens, longest first. A prompt that continues
an entry computes only what follows it. vLLM gets the same from its prefix cache.

Keys and values belong to the weights that computed them: the engine clears the cache on any
weight update, and keys carry the adapter that served the row. An entry is taken (removed) by
the turn that continues it: the next turn stores the longer one. Least recently stored entries
go first past ``capacity_bytes``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from .shared_prefill import left_padded, prefill


@dataclass(frozen=True)
class CachedPrefix:
    """Keys and values of a sequence's first ``length`` tokens, per layer ``[H, length, D]``."""

    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    length: int

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


class PrefixCache:
    """Finished rows' keys and values, found again by the prompts that continue them."""

    def __init__(self, capacity_bytes: int, eos_token_id: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.eos_token_id = eos_token_id
        self.nbytes = 0
        self.hits = 0  # prompts that continued an entry
        self.reused_tokens = 0  # tokens those prompts did not compute again
        self._entries: OrderedDict[tuple[Hashable, tuple[int, ...]], CachedPrefix] = OrderedDict()
        self._lock = threading.Lock()  # calls may come from the compute pool's threads

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

    def take(self, prompt: Sequence[int], tag: Hashable = None) -> CachedPrefix | None:
        """The entry of the longest prefix of ``prompt`` ending at one of its eos tokens, removed
        from the cache; None when there is none."""
        ends = [i + 1 for i, token in enumerate(prompt) if token == self.eos_token_id]
        with self._lock:
            for end in reversed(ends):
                entry = self._entries.pop((tag, tuple(prompt[:end])), None)
                if entry is not None:
                    self.nbytes -= entry.nbytes
                    self.hits += 1
                    self.reused_tokens += entry.length
                    return entry
        return None

    def put(self, tokens: Sequence[int], entry: CachedPrefix, tag: Hashable = None) -> None:
        """Keep ``entry``, the keys and values of all of ``tokens`` but the last (an eos)."""
        if not tokens or tokens[-1] != self.eos_token_id or entry.nbytes > self.capacity_bytes:
            return
        key = (tag, tuple(tokens))
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._entries[key] = entry
            self.nbytes += entry.nbytes
            while self.nbytes > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.nbytes -= evicted.nbytes


def continued_inputs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    prefixes: Sequence[CachedPrefix | None],
    pad_token_id: int,
    device: torch.device,
) -> dict[str, Any] | None:
    """``generate()``'s inputs with the rows' cached prefixes as ``past_key_values``; None when
    no row has one.

    The rows are left-padded to width T, and the last ``tail`` positions of every row are
    computed by ``generate`` (``tail``: the longest part of a row with a prefix that the prefix
    does not cover). The cache holds the first T - tail positions: a row's own keys and values
    at its real tokens, zeros at its padding, which the attention mask hides. A row without a
    prefix (a new episode) has its tokens before the tail computed here, in one forward of all
    such rows. Rotary positions count real tokens only, as generate numbers left-padded rows,
    so every key sits where it was computed.
    """
    lengths = [len(prompt) for prompt in prompts]
    tails = [n - min(p.length, n - 1) for n, p in zip(lengths, prefixes, strict=True) if p]
    if not tails:
        return None
    tail = max(tails)
    width = max(lengths)
    cached = width - tail
    new_rows = [r for r, p in enumerate(prefixes) if p is None and lengths[r] > tail]
    heads = [prompts[r][: lengths[r] - tail] for r in new_rows]  # their tokens before the tail
    computed = dict(zip(new_rows, _prefill(model, heads, pad_token_id, device), strict=True))
    rows = [prefix or computed.get(row) for row, prefix in enumerate(prefixes)]
    layers = []
    template = next(p for p in rows if p is not None)
    for layer, (key, value) in enumerate(template.layers):
        keys_B_H_C_D = key.new_zeros((len(prompts), key.shape[0], cached, key.shape[2]))
        values_B_H_C_D = value.new_zeros((len(prompts), value.shape[0], cached, value.shape[2]))
        for row, prefix in enumerate(rows):
            keep = lengths[row] - tail  # the row's first tokens that lie in the cached part
            if prefix is None or keep <= 0:
                continue
            start = width - lengths[row]
            keys_B_H_C_D[row, :, start:cached] = prefix.layers[layer][0][:, :keep]
            values_B_H_C_D[row, :, start:cached] = prefix.layers[layer][1][:, :keep]
        layers.append((keys_B_H_C_D, values_B_H_C_D))
    input_ids_B_T, attention_mask_B_T = left_padded(prompts, pad_token_id)
    return {
        "input_ids": input_ids_B_T.to(device),
        "attention_mask": attention_mask_B_T.to(device),
        "past_key_values": DynamicCache(ddp_cache_data=layers),
    }


def _prefill(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    pad_token_id: int,
    device: torch.device,
) -> list[CachedPrefix]:
    """Each prompt's keys and values, computed in one left-padded forward; a prompt that
    several rows share (a GRPO group's new episodes) is computed once."""
    if not prompts:
        return []
    slots: dict[tuple[int, ...], int] = {}
    for prompt in prompts:
        slots.setdefault(tuple(prompt), len(slots))
    distinct = list(slots)
    input_ids_B_T, attention_mask_B_T = left_padded(distinct, pad_token_id)
    cache = prefill(model, input_ids_B_T.to(device), attention_mask_B_T.to(device))
    width = input_ids_B_T.shape[1]
    computed = [
        row_prefix(cache, row, width - len(prompt), width) for row, prompt in enumerate(distinct)
    ]
    return [computed[slots[tuple(prompt)]] for prompt in prompts]


def row_prefix(cache: DynamicCache, row: int, start: int, end: int) -> CachedPrefix:
    """Row ``row``'s keys and values at positions ``start:end`` of a batch's cache, copied."""
    layers = tuple(
        (layer.keys[row, :, start:end].clone(), layer.values[row, :, start:end].clone())
        for layer in cache.layers
    )
    return CachedPrefix(layers=layers, length=end - start)
