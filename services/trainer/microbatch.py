"""Micro-batches: a step's episodes cut into pieces that each fit a token budget.

A forward+backward holds activations in proportion to the padded tokens of the batch it runs
on. Running the step as micro-batches, each collated on its own and each backward adding into
the same ``.grad`` (gradient accumulation), bounds that memory by the budget instead of the
step's batch size; the gradient is the whole batch's when each micro-batch's loss is weighted
by its share (for a token mean over the whole batch: divide each micro-batch's masked sum by
the whole batch's number of loss tokens, see ``loss_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .batch import Episode, SequenceBatch, collate


@dataclass(frozen=True)
class MicroBatch:
    """Some of a step's episodes, collated on their own.

    indices: the episodes' positions in the list that was split (to pick their advantages).
    batch: their collated tensors, ``len(indices)`` rows padded to the longest of them.
    """

    indices: list[int]
    batch: SequenceBatch

    @property
    def padded_tokens(self) -> int:
        return int(self.batch.tokens_B_L.numel())


def group_by_token_budget(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` in groups whose padded size (rows x longest row) fits
    ``budget``; a sequence longer than the budget alone makes a group of one. ``budget`` 0
    means no limit (one group).

    Sequences are taken longest first, so sequences of like length share a group and little
    is padding. Every index appears in exactly one group.
    """
    if budget < 0:
        raise ValueError(f"a token budget must be >= 0, got {budget}")
    if budget == 0:
        return [list(range(len(lengths)))] if lengths else []
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        # Longest first: the group's longest row is its first one.
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def split_by_token_budget(episodes: list[Episode], max_tokens: int) -> list[list[int]]:
    """``group_by_token_budget`` of the episodes' lengths (``max_tokens`` >= 1)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    return group_by_token_budget([len(e.token_ids) for e in episodes], max_tokens)


def micro_batches(episodes: list[Episode], pad_id: int, max_tokens: int) -> list[MicroBatch]:
    """``episodes`` split by ``split_by_token_budget`` and each group collated."""
    return [
        MicroBatch(indices, collate([episodes[i] for i in indices], pad_id))
        for indices in split_by_token_budget(episodes, max_tokens)
    ]


def loss_tokens(parts: list[MicroBatch]) -> float:
    """The number of loss-masked (trained) tokens over all micro-batches: the denominator of
    a token mean over the whole step."""
    return float(sum(part.batch.loss_mask_B_T.sum() for part in parts))
