"""Split a minibatch into micro-batches by a token budget (gradient accumulation).

A micro-batch is right-padded to its longest sequence, so it costs ``count * longest`` tokens
of activation memory; the split keeps that at most ``budget``. Order is kept (sequences are
taken as they come), so the same batch always splits the same way.
"""

from __future__ import annotations

from collections.abc import Sequence


def split_by_tokens(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped so that ``len(group) * max(lengths of group) <= budget``.

    ``budget`` 0 means no limit (one group). Raises ValueError when one sequence alone is
    longer than the budget.
    """
    if budget <= 0:
        return [list(range(len(lengths)))] if lengths else []
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, length in enumerate(lengths):
        if length > budget:
            raise ValueError(
                f"a sequence of {length} tokens does not fit micro_batch_tokens {budget}"
            )
        if current and (len(current) + 1) * max(longest, length) > budget:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    if current:
        groups.append(current)
    return groups
