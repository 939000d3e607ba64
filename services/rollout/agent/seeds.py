"""Seeds derived deterministically from a job seed and a position (batch, group, round)."""

from __future__ import annotations

import hashlib


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed that depends only on ``parts`` (stable across processes and runs)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def eval_episode_seed(seed: int, index: int) -> int:
    """The env seed of episode ``index`` of the evaluation stream of ``seed``: what inference
    (in-process or a job) and validation during RL play. Training draws its seeds as
    ``derive_seed(seed, "env", batch, group)``: a different stream."""
    return derive_seed(seed, "env", index)
