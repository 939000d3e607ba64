"""Examples -> batches of at most ``max_tokens_per_batch`` tokens, padded or packed.

Padded: one conversation per row, rows right-padded to the longest row of the batch.
Packed: conversations laid end to end in rows of up to ``max_sequence_length`` tokens.

Either way ``position_ids`` restart at 0 where each conversation (and each row's padding)
starts, and the model is called with them and no attention mask: transformers then reads the
restarts as sequence boundaries and lets a token attend only within its own conversation
(``masking_utils.find_packed_sequence_indices``; tests/trainer/test_sft_data.py checks that packed
logits equal unpacked ones). Padding is a segment of its own with weight 0, so no real token
attends to it and it is never trained on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from opentinker.services.trainer.sft.data import Example


@dataclass(frozen=True)
class SftBatch:
    """One optimizer step's tokens. ``B`` rows of ``L`` tokens.

    tokens_B_L: token ids (pad_id where padded).
    position_ids_B_L: position of each token within its own conversation (or padding run).
    weights_B_L: weight of predicting token ``[b, l]`` from the tokens before it (0 on
        padding, on non-assistant tokens and on each conversation's first token).
    """

    tokens_B_L: torch.Tensor
    position_ids_B_L: torch.Tensor
    weights_B_L: torch.Tensor
    num_examples: int

    @property
    def num_tokens(self) -> int:
        """Tokens in the batch, padding included (what the budget counts)."""
        return int(self.tokens_B_L.numel())


Row = list[Example]  # the conversations laid end to end in one row


def make_batches(
    examples: list[Example],
    *,
    max_tokens: int,
    max_length: int,
    packing: bool,
    pad_id: int,
    shuffle_seed: int | None = None,
) -> list[SftBatch]:
    """Every example exactly once, in batches of at most ``max_tokens`` tokens (rows x the
    longest row). ``shuffle_seed``: shuffle the examples first (None keeps their order)."""
    order = list(examples)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    rows = _pack_rows(order, max_length) if packing else [[e] for e in order]
    batches: list[SftBatch] = []
    current: list[Row] = []
    for row in rows:
        longest = max([_row_length(r) for r in current] + [_row_length(row)])
        if current and longest * (len(current) + 1) > max_tokens:
            batches.append(collate_rows(current, pad_id))
            current = []
        current.append(row)
    if current:
        batches.append(collate_rows(current, pad_id))
    return batches


def _pack_rows(examples: list[Example], max_length: int) -> list[Row]:
    """Consecutive examples laid end to end while the row stays within ``max_length``."""
    rows: list[Row] = []
    for example in examples:
        if rows and _row_length(rows[-1]) + len(example.token_ids) <= max_length:
            rows[-1].append(example)
        else:
            rows.append([example])
    return rows


def _row_length(row: Row) -> int:
    return sum(len(e.token_ids) for e in row)


def collate_rows(rows: list[Row], pad_id: int) -> SftBatch:
    """Rows of examples -> right-padded tensors with per-conversation positions."""
    length = max(_row_length(r) for r in rows)
    tokens_B_L = torch.full((len(rows), length), pad_id, dtype=torch.long)
    positions_B_L = torch.zeros((len(rows), length), dtype=torch.long)
    weights_B_L = torch.zeros((len(rows), length), dtype=torch.float32)
    for b, row in enumerate(rows):
        at = 0
        for example in row:
            n = len(example.token_ids)
            tokens_B_L[b, at : at + n] = torch.tensor(example.token_ids, dtype=torch.long)
            positions_B_L[b, at : at + n] = torch.arange(n)
            weights_B_L[b, at : at + n] = torch.tensor(example.weights, dtype=torch.float32)
            at += n
        positions_B_L[b, at:] = torch.arange(length - at)  # padding: a segment of its own
    return SftBatch(tokens_B_L, positions_B_L, weights_B_L, sum(len(r) for r in rows))
