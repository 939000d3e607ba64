"""Session data: validated Datums and their collation into one padded batch.

A Datum is Tinker's: ``input_tokens`` (T ids) and per-position tensors of length T, where
position t concerns ``target_tokens[t]``, scored as the token after ``input_tokens[0..t]``
(usually the inputs shifted by one; any token is allowed, as in Tinker, e.g. 0 on prompt
positions that carry no loss). The batch is the ``T + 1`` ids ``input_tokens +
[target_tokens[-1]]``; ``targets_B_T`` holds the targets the logprobs are taken of.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from opentinker.errors import InvalidArgumentError, ResourceExhaustedError
from opentinker.services.trainer.rl.batch import SequenceBatch

LossName = Literal[
    "cross_entropy", "importance_sampling", "ppo", "cispo", "gspo", "stable_reinforce", "dro"
]


@dataclass(frozen=True)
class Datum:
    """One example, as plain lists (see the module docstring for the alignment)."""

    input_tokens: list[int]
    target_tokens: list[int]
    weights: list[float] = field(default_factory=list)  # cross_entropy, stable_reinforce; empty = 1
    sampling_logprobs: list[float] = field(default_factory=list)  # importance_sampling / ppo
    advantages: list[float] = field(default_factory=list)  # importance_sampling / ppo
    sequence_ratio_mask: list[float] = field(default_factory=list)  # gspo


@dataclass(frozen=True)
class DatumBatch:
    """``B`` data padded to ``T`` = the longest input. ``batch`` holds the token ids
    (``L = T + 1``); the ``_B_T`` tensors are 0 on padding; ``mask_B_T`` is 1 on real
    positions; ``lengths`` are each datum's T."""

    batch: SequenceBatch
    weights_B_T: torch.Tensor
    sampling_logprobs_B_T: torch.Tensor
    advantages_B_T: torch.Tensor
    mask_B_T: torch.Tensor
    ratio_mask_B_T: torch.Tensor  # gspo's sequence_ratio_mask (0 where not given)
    lengths: list[int]
    targets_B_T: torch.Tensor


def collate_data(
    data: Sequence[Datum], loss: LossName, *, pad_id: int, vocab_size: int, max_tokens: int
) -> DatumBatch:
    """Check every datum for ``loss`` and pad them into a DatumBatch; InvalidArgumentError
    names the first bad datum and field, ResourceExhaustedError a batch over ``max_tokens``."""
    if not data:
        raise InvalidArgumentError("data is empty: send at least one Datum")
    total = sum(len(d.input_tokens) for d in data)
    if total > max_tokens:
        raise ResourceExhaustedError(
            f"data has {total} input tokens, more than this session's max_batch_tokens "
            f"{max_tokens}; split it over several forward_backward calls (gradients add up)"
        )
    for i, d in enumerate(data):
        _check(i, d, loss, vocab_size)
    size, width = len(data), max(len(d.input_tokens) for d in data)
    tokens_B_L = torch.full((size, width + 1), pad_id, dtype=torch.long)
    attention_B_L = torch.zeros((size, width + 1), dtype=torch.long)
    targets_B_T = torch.full((size, width), pad_id, dtype=torch.long)
    per_token = {name: torch.zeros((size, width)) for name in ("w", "q", "a", "m", "r")}
    for b, d in enumerate(data):
        n = len(d.input_tokens)
        tokens_B_L[b, : n + 1] = torch.tensor([*d.input_tokens, d.target_tokens[-1]])
        attention_B_L[b, : n + 1] = 1
        targets_B_T[b, :n] = torch.tensor(d.target_tokens)
        per_token["w"][b, :n] = torch.tensor(d.weights) if d.weights else 1.0
        if d.sampling_logprobs:
            per_token["q"][b, :n] = torch.tensor(d.sampling_logprobs)
        if d.advantages:
            per_token["a"][b, :n] = torch.tensor(d.advantages)
        if d.sequence_ratio_mask:
            per_token["r"][b, :n] = torch.tensor(d.sequence_ratio_mask)
        per_token["m"][b, :n] = 1.0
    batch = SequenceBatch(tokens_B_L, attention_B_L, per_token["m"], per_token["q"])
    return DatumBatch(
        batch=batch,
        weights_B_T=per_token["w"] * per_token["m"],
        sampling_logprobs_B_T=per_token["q"],
        advantages_B_T=per_token["a"],
        mask_B_T=per_token["m"],
        ratio_mask_B_T=per_token["r"],
        lengths=[len(d.input_tokens) for d in data],
        targets_B_T=targets_B_T,
    )


def _check(i: int, d: Datum, loss: LossName, vocab_size: int) -> None:
    n = len(d.input_tokens)

    def bad(message: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"data[{i}]: {message}", reason="INVALID_DATUM")

    if n == 0:
        raise bad("input_tokens is empty")
    if len(d.target_tokens) != n:
        raise bad(f"target_tokens has {len(d.target_tokens)} ids, input_tokens {n}")
    outside = [t for t in (*d.input_tokens, *d.target_tokens) if not 0 <= t < vocab_size]
    if outside:
        raise bad(f"token ids outside the vocabulary 0..{vocab_size - 1}: {outside[:3]}")
    for name in ("weights", "sampling_logprobs", "advantages", "sequence_ratio_mask"):
        values = getattr(d, name)
        if values and len(values) != n:
            raise bad(f"{name} has {len(values)} entries, input_tokens {n}")
        # One NaN or inf makes the loss and every gradient non-finite: optim_step would then
        # write NaN into every trained weight.
        at = next((t for t, v in enumerate(values) if not math.isfinite(v)), None)
        if at is not None:
            raise bad(f"{name}[{at}] is {values[at]}: every value must be finite")
    if loss != "cross_entropy":
        for name in ("sampling_logprobs", "advantages"):
            if not getattr(d, name):
                raise bad(f"loss {loss!r} needs {name} ({n} entries)")
    if loss == "gspo" and not d.sequence_ratio_mask:
        raise bad(f"loss 'gspo' needs sequence_ratio_mask ({n} entries, 1 on sampled tokens)")
    if loss == "stable_reinforce" and not d.weights:
        # Its KL term covers every weighted position: weights left out (all 1) fitted the
        # prompt's tokens too (their sampling logprobs are 0), as SFT on the prompt would.
        raise bad(f"loss 'stable_reinforce' needs weights ({n} entries, 1 on sampled tokens)")
