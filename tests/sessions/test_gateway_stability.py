"""stable_reinforce's provenance in the gateway: the SDK's own encoder on one side, the
sampling records on the other (no network)."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from opentinker.errors import InvalidArgumentError
from opentinker.services.gateway import wire
from opentinker.services.gateway.stability import (
    SampledRecord,
    StabilityRecords,
    with_recorded_logprobs,
)

pytestmark = pytest.mark.unit

# prompt [3, 4, 5], sampled [6, 7]: inputs 3 4 5 6, targets 0 0 6 7 (the cookbook puts 0 on
# prompt rows): 2 prompt rows (prompt tokens 1..2), then the 2 sampled rows
RECORD = SampledRecord.of(np.array([3, 4, 5], np.int32), [6, 7], [-0.5, -0.25])


def request(targets, advantages, spans=True, sid="r:0"):
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([3, 4, 5, 6]),
        loss_fn_inputs={
            "target_tokens": np.array(targets, dtype=np.int64),
            "logprobs": np.array([0.0, 0.0, -9.0, -9.0], dtype=np.float32),  # client's: ignored
            "advantages": np.array(advantages, dtype=np.float32),
        },
    )
    if spans:
        datum = datum.with_provenance(
            model_input=[
                types.PromptProvenanceSpan(sequence_id=sid, length=3),
                types.SampledProvenanceSpan(sequence_id=sid, length=1),
            ],
            loss_fn_inputs=[
                types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=2),
                types.SampledProvenanceSpan(sequence_id=sid, length=2),
            ],
        )
    fb = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum], loss_fn="stable_reinforce", loss_fn_config={"kl_coeff": 0.1}
        ),
        model_id="s:train:0",
        seq_id=1,
    )
    return wire.parse_forward_backward(forward_backward_request_to_proto(fb).SerializeToString())


def resolve(pb):
    records = StabilityRecords()
    records.record("r:0", RECORD)
    return with_recorded_logprobs(pb, wire.session_data(pb), records)


def test_sampled_rows_train_on_the_recorded_logprobs() -> None:
    pb = request([0, 0, 6, 7], [0.0, 0.0, 1.0, 1.0])
    assert wire.loss_options(pb.loss_fn, wire.loss_config(pb)) == {"kl_coeff": pytest.approx(0.1)}
    [datum] = resolve(pb)
    # the recorded -0.5, -0.25 replace the client's -9; only the sampled rows are trained
    assert datum.sampling_logprobs == [0.0, 0.0, -0.5, -0.25]
    assert datum.weights == [0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("targets", "advantages", "kwargs", "message"),
    [
        ([0, 0, 6, 8], [0, 0, 1, 1], {}, "differ from the tokens sampled"),
        ([0, 0, 6, 7], [0, 1, 1, 1], {}, "nonzero advantages on prompt positions"),
        ([0, 0, 6, 7], [0, 0, 1, 1], {"spans": False}, "needs provenance"),
        ([0, 0, 6, 7], [0, 0, 1, 1], {"sid": "r:9"}, "record_stability_info=True"),
    ],
)
def test_a_bad_claim_is_refused_naming_it(targets, advantages, kwargs, message) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        resolve(request(targets, advantages, **kwargs))


def test_records_expire_and_the_oldest_go_first() -> None:
    records = StabilityRecords(ttl_s=0.0, limit=2)
    records.record("a", RECORD)
    with pytest.raises(InvalidArgumentError, match="'a'"):
        records.get("a", "here")  # past its (zero) day
    kept = StabilityRecords(limit=2)
    for name in "abc":
        kept.record(name, RECORD)
    assert kept.get("c", "here") is RECORD
    with pytest.raises(InvalidArgumentError):
        kept.get("a", "here")  # the oldest, dropped past the limit
