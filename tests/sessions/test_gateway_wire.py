"""The gateway's translation of Tinker's wire format (the tinker SDK's own encoders and
decoders on the other side) and its seq_id ordering."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_proto_response

from opentinker.errors import FailedPreconditionError, InvalidArgumentError
from opentinker.services.gateway import runs, wire
from opentinker.services.gateway.futures import error_body
from opentinker.services.gateway.models import TinkerPath
from opentinker.services.gateway.ordering import SeqGate
from opentinker.services.gateway.sessions import SessionGoneError, Sessions
from opentinker.services.gateway.stops import cut_at_stop, parse_stop
from opentinker.training_session import ForwardOutput, SampledSequence, SampleOutput

pytestmark = pytest.mark.unit


def sdk_request(loss_fn: str = "importance_sampling", **config: float) -> bytes:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([3, 4, 5]),
        loss_fn_inputs={
            "target_tokens": np.array([4, 5, 6], dtype=np.int64),
            "logprobs": np.array([-1.0, -0.5, -0.25], dtype=np.float32),
            "advantages": np.array([0.0, 1.0, 1.0], dtype=np.float32),
        },
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum], loss_fn=loss_fn, loss_fn_config=config or None
        ),
        model_id="s:train:0",
        seq_id=3,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def test_an_sdk_forward_backward_request_becomes_session_data() -> None:
    request = wire.parse_forward_backward(sdk_request())
    [datum] = wire.session_data(request)
    assert (request.model_id, request.seq_id, request.loss_fn) == (
        "s:train:0",
        3,
        "importance_sampling",
    )
    assert datum.input_tokens == [3, 4, 5] and datum.target_tokens == [4, 5, 6]
    assert datum.sampling_logprobs == [-1.0, -0.5, -0.25]
    assert datum.advantages == [0.0, 1.0, 1.0] and datum.weights is None


def test_losses_are_checked_with_their_options() -> None:
    assert wire.loss_options("ppo", {"clip_low_threshold": 0.7}) == {"clip_low_threshold": 0.7}
    assert wire.loss_options("dro", {"beta": 0.5}) == {"kl_coeff": 0.5}  # Tinker's beta
    with pytest.raises(InvalidArgumentError, match="'my_loss' is not supported"):
        wire.loss_options("my_loss", {})
    with pytest.raises(InvalidArgumentError, match="loss_fn_config"):
        wire.loss_options("cross_entropy", {"clip_low_threshold": 0.7})


def test_outputs_decode_with_the_sdks_own_decoders() -> None:
    output = ForwardOutput(
        loss=1.5, logprobs=[[-0.5, -1.0], [-0.25]], metrics={"loss:sum": 1.5, "tokens": 3.0}
    )
    decoded = deserialize_proto_response(
        wire.forward_backward_output(output), types.ForwardBackwardOutput
    )
    assert [o["logprobs"].tolist() for o in decoded.loss_fn_outputs] == [[-0.5, -1.0], [-0.25]]
    # Every metric carries the reduction the SDK folds chunks with.
    assert decoded.metrics == {"loss:sum": 1.5, "tokens:sum": 3.0}

    sample = SampleOutput([SampledSequence([7, 2], [-0.5, -0.125], "stop")], policy_version=1)
    [seq] = deserialize_proto_response(wire.sample_response(sample), types.SampleResponse).sequences
    assert (seq.tokens, seq.logprobs, seq.stop_reason) == ([7, 2], [-0.5, -0.125], "stop")


def test_prompt_logprobs_reach_the_sdk_with_none_where_unscored() -> None:
    sample = SampleOutput([SampledSequence([7], [-0.5], "length")], policy_version=1)
    scored = wire.prompt_logprobs([-1.0, -2.0, -3.0], last_n=2)  # a 4-token prompt
    decoded = deserialize_proto_response(
        wire.sample_response(sample, prompt_logprobs=scored), types.SampleResponse
    )
    # first token: never scored; last_n=2 keeps the last two of [-1, -2, -3]
    assert decoded.prompt_logprobs == [None, None, -2.0, -3.0]
    assert wire.prompt_logprobs([-1.0], last_n=None) == pytest.approx(
        [float("nan"), -1.0], nan_ok=True
    )


def test_prompts_and_stops() -> None:
    prompt = types.ModelInput.from_ints([1, 2, 3]).model_dump(mode="json")
    assert wire.prompt_tokens(prompt) == [1, 2, 3]
    assert parse_stop([5, 6]) == ([5, 6], []) and parse_stop(None) == ([], [])
    assert parse_stop("\n\nUser:") == ([], ["\n\nUser:"])
    with pytest.raises(InvalidArgumentError, match="not a mix"):
        parse_stop(["</s>", 5])


def test_a_stop_string_ends_the_sequence_with_the_token_that_completes_it() -> None:
    pieces = {1: "ab", 2: "c\n", 3: "\nUs", 4: "er:", 5: "x"}  # token id -> its text

    def decode(ids: list[int]) -> str:
        return "".join(pieces[i] for i in ids)

    seq = SampledSequence(
        tokens=[1, 2, 3, 4, 5], logprobs=[-1, -2, -3, -4, -5], stop_reason="length"
    )
    # "\n\nUser:" spans tokens 2..4 ("c\n" + "\nUs" + "er:"): token 4 completes it, kept
    cut = cut_at_stop(seq, ["\n\nUser:"], decode)
    assert (cut.tokens, cut.logprobs, cut.stop_reason) == ([1, 2, 3, 4], [-1, -2, -3, -4], "stop")
    # the first of several stop strings wins; "c" ends inside token 2
    assert cut_at_stop(seq, ["er:", "c"], decode).tokens == [1, 2]
    assert cut_at_stop(seq, ["zz"], decode) == seq  # none found: unchanged


def test_tinker_paths_name_a_session_jobs_state() -> None:
    path = TinkerPath.parse("tinker://job-1/weights/after")
    assert (
        path.trainer_state == "job-1/states/after" and str(path) == "tinker://job-1/weights/after"
    )
    with pytest.raises(InvalidArgumentError, match="tinker://"):
        TinkerPath.parse("/tmp/job-1/states/after")
    for escape in ("tinker://job-1/weights/..", "tinker://../weights/a", "tinker://j/weights/."):
        with pytest.raises(InvalidArgumentError, match="only dots"):
            TinkerPath.parse(escape)  # would name a folder above the run's states


def test_a_state_name_of_only_dots_is_refused_before_anything_is_written(tmp_path) -> None:
    from opentinker.services.trainer.session.state import SavedSession, save_state
    from opentinker.spec import ModelSpec

    owner = SavedSession(tenant_id="t", job_id="job-1", model=ModelSpec(base_model="m"), step=0)
    for name in (".", "..", "a/b"):  # ".." would write (and prune) the job's own folder
        with pytest.raises(InvalidArgumentError, match="not only dots"):
            save_state(None, root=tmp_path, name=name, owner=owner)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_errors_say_who_is_to_blame() -> None:
    assert error_body(InvalidArgumentError("loss_fn: no")) == {
        "error": "loss_fn: no",
        "category": "user",
    }
    assert error_body(RuntimeError("boom"))["category"] == "server"


def test_the_seq_gate_lets_calls_through_in_order() -> None:
    async def scenario() -> list[int]:
        gate, order = SeqGate(wait_s=5), []

        async def call(seq: int) -> None:
            await gate.wait_turn(seq)
            order.append(seq)
            await gate.advance()

        await asyncio.gather(call(3), call(1), call(2))  # arrive out of order
        with pytest.raises(FailedPreconditionError, match="already used"):
            await gate.wait_turn(2)
        late = SeqGate(wait_s=0.05)
        with pytest.raises(FailedPreconditionError, match="never came"):
            await late.wait_turn(2)
        return order

    assert asyncio.run(scenario()) == [1, 2, 3]


def test_sessions_expire_when_silent_but_not_while_a_call_runs() -> None:
    sessions = Sessions(expiry_s=0.05)
    quiet, busy = sessions.create("acme"), sessions.create("acme")
    with sessions.active(f"{busy}:train:1"):  # a call on one of its models
        time.sleep(0.1)
        assert sessions.expired() == [quiet]
    assert sessions.expired() == []  # the call just ended: a sign of life
    time.sleep(0.1)
    assert sessions.expired() == [busy]
    with pytest.raises(SessionGoneError, match="ended"):
        sessions.beat(busy, "acme")
    live = sessions.create("acme")
    with pytest.raises(SessionGoneError):
        sessions.beat(live, "another-tenant")


def test_states_past_their_ttl_are_deleted(tmp_path) -> None:
    old, fresh, kept = (tmp_path / "job-1" / "states" / n for n in ("old", "fresh", "kept"))
    for folder, expires_at in ((old, time.time() - 1), (fresh, time.time() + 600), (kept, None)):
        folder.mkdir(parents=True)
        if expires_at is not None:
            (folder / runs.TTL_FILE).write_text(json.dumps({"expires_at": expires_at}))
    assert runs.delete_expired(tmp_path) == [old]
    assert not old.exists() and fresh.is_dir() and kept.is_dir()
