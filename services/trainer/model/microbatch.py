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

from opentinker.services.trainer.rl.batch import Episode, SequenceBatch, collate


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


def group_by_token_budget(
    lengths: Sequence[int], budget: int, max_padding: float = 1.0
) -> list[list[int]]:
    """Indices of ``lengths`` in groups whose padded size (rows x longest row) fits
    ``budget`` and of whose padded tokens at most ``max_padding`` are padding; a sequence
    longer than the budget alone makes a group of one. ``budget`` 0 means no limit, and
    ``max_padding`` 1 no cut for padding (with both, one group).

    Sequences are taken longest first, so sequences of like length share a group (its rows
    then in their given order: a batch that needs no cut runs as one pass would). The padding
    cut matters for episodes of very different lengths (multi-turn episodes of 1 to 8 turns):
    a forward over rows padded to the longest computes the padding too, in every layer and,
    quadratically, in attention, while the gradients summed over groups are the same.
    Every index appears in exactly one group.
    """
    if budget < 0:
        raise ValueError(f"a token budget must be >= 0, got {budget}")
    if not 0.0 <= max_padding <= 1.0:
        raise ValueError(f"max_padding is a share of a group's tokens in [0, 1], got {max_padding}")
    if budget == 0 and max_padding >= 1.0:
        return [list(range(len(lengths)))] if lengths else []
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    real = 0  # the last group's tokens without padding
    for i in order:
        if groups:  # longest first: the group's longest row is its first one
            padded = (len(groups[-1]) + 1) * lengths[groups[-1][0]]
            within_budget = budget == 0 or padded <= budget
            if within_budget and real + lengths[i] >= (1.0 - max_padding) * padded:
                groups[-1].append(i)
                real += lengths[i]
                continue
        groups.append([i])
        real = lengths[i]
    return [sorted(group) for group in groups]  # a group's rows in the order they came


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
