"""StableReinforce's sampling records and the provenance that names them (Tinker's
``record_stability_info`` and ``Datum.with_provenance``).

A sampling client made with ``record_stability_info=True`` has every sequence it samples
recorded under its ``sequence_id``: the prompt, the sampled tokens and the sampler's logprobs.
A ``stable_reinforce`` forward_backward names, per datum, the sampled sequence behind each
position (``loss_fn_input_spans`` tiling the targets, ``model_input_spans`` the inputs); the
gateway checks the claims against the records and trains on the *recorded* sampler logprobs,
not the ones the client sent. Records live with the training model in this gateway process
(like futures in flight): a sequence can be trained on for a day after its last use, and a
gateway restart forgets them (sample again).
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as tinker_pb

from opentinker.errors import InvalidArgumentError
from opentinker.training_session import Datum

RECORD_TTL_S = 86_400.0  # Tinker: trainable for one day after sampling, renewed by each use
# Per training model, the oldest go first: rl_loop's defaults sample 2,048 sequences a step,
# so the last 32 steps stay trainable (~8 bytes a token: the arrays below).
MAX_RECORDS = 65_536


@dataclass(frozen=True, eq=False)
class SampledRecord:
    """One recorded sequence: its request's prompt (int32, shared by the request's samples),
    the sampled tokens (int32) and their logprobs (float32)."""

    prompt: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray

    @classmethod
    def of(cls, prompt: np.ndarray, tokens: Sequence[int], logprobs: Sequence[float]):
        return cls(prompt, np.asarray(tokens, np.int32), np.asarray(logprobs, np.float32))


class StabilityRecords:
    """The recorded sequences of one training model, by sequence id."""

    def __init__(self, *, ttl_s: float = RECORD_TTL_S, limit: int = MAX_RECORDS) -> None:
        self._ttl_s, self._limit = ttl_s, limit
        self._by_id: OrderedDict[str, tuple[SampledRecord, float]] = OrderedDict()

    def record(self, sequence_id: str, record: SampledRecord) -> None:
        self._by_id[sequence_id] = (record, time.monotonic())
        self._by_id.move_to_end(sequence_id)
        while len(self._by_id) > self._limit:
            self._by_id.popitem(last=False)

    def record_sample(
        self, sequence_ids: Sequence[str], prompt: Sequence[int], sequences: Sequence[Any]
    ) -> None:
        """Record one sample request's sequences (each with ``tokens`` and ``logprobs``)."""
        shared = np.asarray(prompt, np.int32)
        for sequence_id, seq in zip(sequence_ids, sequences, strict=True):
            self.record(sequence_id, SampledRecord.of(shared, seq.tokens, seq.logprobs))

    def get(self, sequence_id: str, where: str) -> SampledRecord:
        entry = self._by_id.get(sequence_id)
        if entry is None or time.monotonic() - entry[1] > self._ttl_s:
            self._by_id.pop(sequence_id, None)
            raise InvalidArgumentError(
                f"{where}: sequence {sequence_id!r} has no stability record here; sample it "
                "with a sampling client of this training client made with "
                "record_stability_info=True (records last a day, and not across a gateway "
                "restart)"
            )
        self.record(sequence_id, entry[0])  # each use restarts its day
        return entry[0]


def with_recorded_logprobs(
    request: tinker_pb.ForwardBackwardRequest, data: Sequence[Datum], records: StabilityRecords
) -> list[Datum]:
    """``data`` (parsed from ``request``) with each datum's sampling logprobs taken from the
    records its provenance names; InvalidArgumentError names the first bad claim."""
    out = []
    for i, (proto, datum) in enumerate(zip(request.data, data, strict=True)):
        where = f"data[{i}]"
        if not proto.loss_fn_input_spans:
            raise InvalidArgumentError(
                f"{where}: loss_fn 'stable_reinforce' needs provenance on every datum "
                "(Datum.with_provenance naming the sampled sequences)"
            )
        _check_inputs(f"{where}.model_input_spans", proto.model_input_spans, datum, records)
        logprobs, sampled = _target_logprobs(f"{where}.loss_fn_input_spans", proto, datum, records)
        # weights mark the positions stable_reinforce trains (its KL term too): the sampled ones
        out.append(dataclasses.replace(datum, sampling_logprobs=logprobs, weights=sampled))
    return out


def _runs(where: str, spans, length: int, records: StabilityRecords):
    """(position, sampled?, record, offset, run length) per span, after checking the tiling."""
    if any(span.WhichOneof("span") is None for span in spans):
        raise InvalidArgumentError(f"{where}: a span is neither prompt nor sampled tokens")
    total = sum(_arm(span).length for span in spans)
    if total != length:
        raise InvalidArgumentError(f"{where}: spans cover {total} positions, the field {length}")
    position = 0
    for k, span in enumerate(spans):
        arm = _arm(span)
        record = records.get(arm.sequence_id, f"{where}[{k}]")
        sampled = span.WhichOneof("span") == "sampled_tokens"
        source = record.tokens if sampled else record.prompt
        if arm.offset + arm.length > len(source):
            raise InvalidArgumentError(
                f"{where}[{k}]: positions {arm.offset}..{arm.offset + arm.length} are past the "
                f"{len(source)} {'sampled' if sampled else 'prompt'} tokens of {arm.sequence_id!r}"
            )
        yield position, sampled, record, arm.offset, arm.length
        position += arm.length


def _arm(span: tinker_pb.ProvenanceSpan):
    return (
        span.sampled_tokens if span.WhichOneof("span") == "sampled_tokens" else span.prompt_tokens
    )


def _check_inputs(where: str, spans, datum: Datum, records: StabilityRecords) -> None:
    """The input tokens are the tokens the spans claim."""
    tokens = datum.input_tokens
    for k, (pos, sampled, record, offset, n) in enumerate(
        _runs(where, spans, len(tokens), records)
    ):
        source = record.tokens if sampled else record.prompt
        if tokens[pos : pos + n] != source[offset : offset + n].tolist():
            raise InvalidArgumentError(
                f"{where}[{k}]: input tokens {pos}..{pos + n} differ from the recorded tokens"
            )


def _target_logprobs(
    where: str, proto, datum: Datum, records: StabilityRecords
) -> tuple[list[float], list[float]]:
    """The recorded sampler logprob at each sampled target (0 on prompt positions, whose
    advantage must be 0: only sampled tokens are trained), and 1/0 marking sampled targets."""
    targets, advantages = datum.target_tokens, datum.advantages or [0.0] * len(datum.target_tokens)
    logprobs, sampled_at = [0.0] * len(targets), [0.0] * len(targets)
    spans = proto.loss_fn_input_spans
    for k, (pos, sampled, record, offset, n) in enumerate(
        _runs(where, spans, len(targets), records)
    ):
        if not sampled:
            if any(advantages[pos : pos + n]):
                raise InvalidArgumentError(
                    f"{where}[{k}]: nonzero advantages on prompt positions {pos}..{pos + n}; "
                    "stable_reinforce trains sampled tokens only"
                )
            continue
        if targets[pos : pos + n] != record.tokens[offset : offset + n].tolist():
            raise InvalidArgumentError(
                f"{where}[{k}]: target tokens {pos}..{pos + n} differ from the tokens sampled "
                f"for {_arm(spans[k]).sequence_id!r}"
            )
        logprobs[pos : pos + n] = record.logprobs[offset : offset + n].tolist()
        sampled_at[pos : pos + n] = [1.0] * n
    return logprobs, sampled_at
