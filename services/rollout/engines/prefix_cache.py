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
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from opentinker.services.rollout.engines.shared_prefill import left_padded, prefill
from opentinker.services.rollout.types import Completion


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

    def count(self, tag: Hashable) -> int:
        """How many entries ``tag`` holds."""
        with self._lock:
            return sum(key[0] == tag for key in self._entries)

    def drop(self, tag: Hashable) -> None:
        """Forget the entries of ``tag`` (an adapter whose weights changed or that left)."""
        with self._lock:
            for key in [key for key in self._entries if key[0] == tag]:
                self.nbytes -= self._entries.pop(key).nbytes

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

    def continued(
        self,
        model: torch.nn.Module,
        prompts: Sequence[Sequence[int]],
        tags: Sequence[Hashable],
        pad_token_id: int,
        device: torch.device,
        forward_kwargs: Callable[[list[int]], dict[str, Any]] = lambda rows: {},
    ) -> dict[str, Any] | None:
        """``generate()``'s inputs continuing the entries the rows find (each row under its
        tag), taken from the cache; None when none finds one (``continued_inputs``)."""
        found = [self.take(prompt, tag) for prompt, tag in zip(prompts, tags, strict=True)]
        if not any(found):
            return None
        return continued_inputs(
            model, prompts, found, pad_token_id, device, tags=tags, forward_kwargs=forward_kwargs
        )

    def keep_rows(
        self,
        kv: object,
        width: int,
        rows: Iterable[tuple[int, Sequence[int], Completion, Hashable]],
    ) -> None:
        """Keep each of ``rows`` (row, prompt, completion, tag) of a ``generate()`` call whose
        prompts were left-padded to ``width``: the keys and values in its cache ``kv`` of the
        row's prompt and completion but the last token, if that is eos."""
        if not isinstance(kv, DynamicCache):
            return
        for row, prompt, completion, tag in rows:
            if completion.token_ids and completion.token_ids[-1] == self.eos_token_id:
                start, end = width - len(prompt), width + len(completion.token_ids) - 1
                self.put([*prompt, *completion.token_ids], row_prefix(kv, row, start, end), tag)


def continued_inputs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    prefixes: Sequence[CachedPrefix | None],
    pad_token_id: int,
    device: torch.device,
    *,
    tags: Sequence[Hashable] | None = None,
    forward_kwargs: Callable[[list[int]], dict[str, Any]] = lambda rows: {},
) -> dict[str, Any] | None:
    """``generate()``'s inputs with the rows' cached prefixes as ``past_key_values``; None when
    no row has one. ``tags`` and ``forward_kwargs`` as in ``shared_prefill.prompt_inputs`` (a
    row's adapter, and the model's arguments for some rows: their adapter names).

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
    heads = {r: prompts[r][: lengths[r] - tail] for r in new_rows}  # their tokens before the tail
    computed = _prefill(model, heads, pad_token_id, device, tags, forward_kwargs)
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
    heads: dict[int, Sequence[int]],
    pad_token_id: int,
    device: torch.device,
    tags: Sequence[Hashable] | None,
    forward_kwargs: Callable[[list[int]], dict[str, Any]],
) -> dict[int, CachedPrefix]:
    """Each row's keys and values of its tokens in ``heads`` (row -> tokens), computed in one
    left-padded forward; rows with the same tokens and tag (a GRPO group's new episodes) are
    computed once."""
    if not heads:
        return {}
    keys = {row: (tags[row] if tags else None, tuple(tokens)) for row, tokens in heads.items()}
    slots: dict[tuple[Hashable, tuple[int, ...]], int] = {}
    distinct: list[int] = []  # the first row of each slot
    for row, key in keys.items():
        if key not in slots:
            slots[key] = len(distinct)
            distinct.append(row)
    input_ids_B_T, attention_mask_B_T = left_padded([heads[r] for r in distinct], pad_token_id)
    cache = prefill(
        model, input_ids_B_T.to(device), attention_mask_B_T.to(device), **forward_kwargs(distinct)
    )
    width = input_ids_B_T.shape[1]
    computed = [
        row_prefix(cache, slot, width - len(heads[row]), width) for slot, row in enumerate(distinct)
    ]
    return {row: computed[slots[key]] for row, key in keys.items()}


def row_prefix(cache: DynamicCache, row: int, start: int, end: int) -> CachedPrefix:
    """Row ``row``'s keys and values at positions ``start:end`` of a batch's cache, copied."""
    # A full-attention model's layers (DynamicLayer), filled by the forward: transformers
    # types them as any cache layer, whose keys may be unset.
    layers = tuple(
        (layer.keys[row, :, start:end].clone(), layer.values[row, :, start:end].clone())  # type: ignore[union-attr,index]
        for layer in cache.layers
    )
    return CachedPrefix(layers=layers, length=end - start)
