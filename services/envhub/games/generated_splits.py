"""Train and validation splits for environments that generate their problems from a seed.

``split=validation`` is a fixed set of ``size`` problems drawn once from the env's own stream
(the seed picks one of them, so the same seeds give the same set every time); ``train`` draws a
fresh problem from each seed and never hands out one of the validation set, so a validation
accuracy measures problems training never saw.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Hashable
from typing import TypeVar

P = TypeVar("P", bound=Hashable)
SPLITS = ("train", "validation")


def problem_for(
    name: str, seed: int, split: str, make: Callable[[random.Random], P], *, size: int = 256
) -> P:
    """The problem ``seed`` gives in ``split`` of the problem stream ``name`` (one generator
    ``make`` per name); ValueError for another split."""
    if split not in SPLITS:
        raise ValueError(f"env option split must be 'train' or 'validation', got {split!r}")
    held_out = _validation(name, make, size)
    if split == "validation":
        return held_out[seed % size]
    rng = random.Random(f"{name}-train-{seed}")
    while (problem := make(rng)) in held_out:
        pass
    return problem


_VALIDATION: dict[tuple[str, int], tuple[Hashable, ...]] = {}
_LOCK = threading.Lock()  # env servers reset episodes on many threads


def _validation(name: str, make: Callable[[random.Random], P], size: int) -> tuple[P, ...]:
    """The validation set of stream ``name``, made once (one generator per name)."""
    with _LOCK:
        if (name, size) not in _VALIDATION:
            rng = random.Random(f"{name}-validation")
            _VALIDATION[name, size] = tuple(make(rng) for _ in range(size))
        return _VALIDATION[name, size]  # type: ignore[return-value]
