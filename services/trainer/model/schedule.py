"""The learning-rate schedule of a job: linear warmup, then constant, linear or cosine decay.

A pure function of the step, so a resumed job needs no scheduler state: the loop sets the
optimizer's LR from (step, base LR) before each step's update.
"""

from __future__ import annotations

import math
from typing import Literal

LrSchedule = Literal["constant", "linear", "cosine"]


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, schedule: LrSchedule) -> float:
    """The multiplier of the base LR at 0-based ``step`` (of ``total_steps``).

    Warmup: ``(step + 1) / warmup_steps`` while ``step < warmup_steps`` (the first step already
    learns; step ``warmup_steps - 1`` reaches the full LR). After it, with
    ``progress = (step - warmup) / (total - warmup)`` in [0, 1): constant 1, linear
    ``1 - progress``, cosine ``(1 + cos(pi * progress)) / 2``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    raise ValueError(f"unknown lr_schedule {schedule!r}: use constant, linear or cosine")
