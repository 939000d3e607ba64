"""Weight updates that scale: bucketed chunks cut lazily from the live tensors, applied tensor
by tensor as they complete, and only the tensors that changed since the last acknowledged
update (weights.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from identity_helpers import user_key
from rollout_helpers import session_rollout

from opentinker.rollout.v1 import rollout_pb2
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.modeling.weights import ChangedTensors, WeightStream, pack_weights
from opentinker.services.rollout.service import create_server as create_rollout
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.rollout_link.rollout_client import GrpcRolloutSession
from opentinker.services.trainer.rollout_link.weight_sync import verified_sync
from opentinker.spec import JobSpec, ModelSpec, to_proto


def sample_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "big": torch.randn(10, 30),  # 1200 bytes: split over several 256-byte chunks
        "half": torch.randn(16, 16).to(torch.bfloat16),  # 512 bytes, travels as bf16
        "small": torch.randn(3),  # 12 bytes
        "empty": torch.zeros(0),
    }


def test_chunks_round_trip_and_each_tensor_is_handed_on_once_complete() -> None:
    tensors = sample_tensors()
    chunks = list(pack_weights(tensors, policy_version=3, is_adapter=False, max_chunk_bytes=256))
    # big: 4 x 256 + 176 bytes (chunks 0-4; 176 + half's first 256 > 256), half: 2 x 256
    # (chunks 5-6), small + empty together in the last (chunk 7).
    assert len(chunks) == 8
    assert all(sum(len(t.data) for t in c.tensors) <= 256 for c in chunks)
    stream = WeightStream()
    completed_at: dict[str, int] = {}
    received: dict[str, torch.Tensor] = {}
    for index, chunk in enumerate(chunks):
        done = stream.add(chunk)
        completed_at.update(dict.fromkeys(done, index))
        received.update(done)
    assert completed_at["big"] == 4  # its fifth piece, not the last chunk of the update
    assert stream.tensors_received == 4
    for name, tensor in tensors.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor)
    assert chunks[-1].last and not any(c.last for c in chunks[:-1])


def test_malformed_streams_are_refused_naming_the_tensor() -> None:
    first_piece = next(
        pack_weights({"a": torch.ones(100)}, policy_version=1, is_adapter=False, max_chunk_bytes=64)
    )
    interleaved = next(pack_weights({"b": torch.ones(2)}, policy_version=1, is_adapter=False))
    stream = WeightStream()
    stream.add(first_piece)
    with pytest.raises(ValueError, match="'b' started before tensor 'a'"):
        stream.add(interleaved)
    cut = WeightStream()
    first_piece.last = True
    with pytest.raises(ValueError, match=r"'a' is incomplete: 64/400 bytes"):
        cut.add(first_piece)


def test_only_tensors_changed_since_the_acknowledged_update_travel() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    state = {n: p.detach() for n, p in model.named_parameters()}
    tracker = ChangedTensors()
    first, stamps = tracker.changed(state)
    assert set(first) == set(state)  # nothing served yet: everything
    tracker.acknowledge(stamps)
    assert tracker.changed(state)[0] == {}  # not acknowledged again: ...
    again, stamps = tracker.changed(state)
    assert set(again) == set(state)  # ... so the next update sends everything
    tracker.acknowledge(stamps)

    # One step that only touches the second layer (the first has no gradient: AdamW skips it).
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model[1](torch.ones(1, 3)).sum().backward()
    optimizer.step()
    changed, stamps = tracker.changed(state)
    assert set(changed) == {"1.weight", "1.bias"}
    tracker.acknowledge(stamps)
    tracker.forget()  # a new rollout
    assert set(tracker.changed(state)[0]) == set(state)


def test_a_fresh_tensor_never_passes_for_the_one_it_replaces() -> None:
    """Gathered copies (full_state on several ranks) are new tensors every time: freeing the
    old one and allocating the next of the same size may reuse its address, with the version
    counter at 0 both times. The tracker holds what it stamped, so that cannot happen."""
    tracker = ChangedTensors()
    for value in range(20):
        state = {"w": torch.full((4096,), float(value))}  # a new tensor each time, same shape
        changed, stamps = tracker.changed(state)
        assert set(changed) == {"w"}, value  # each holds new values: each must travel
        tracker.acknowledge(stamps)
        del state, changed, stamps


@pytest.mark.integration
def test_a_second_sync_sends_only_the_changed_tensor_and_the_probe_passes(tmp_path) -> None:
    """Trainer policy -> real in-process rollout server over gRPC: the first update carries
    every tensor, the next only the one written since; the rollout's probe proves it serves
    the trainer's weights both times (float32 on CPU: tolerance 1e-3)."""

    async def main() -> tuple[list[int], list[float]]:
        model_dir = ensure_tiny_model(tmp_path / "tiny-qwen2")
        spec = ModelSpec(base_model=str(model_dir), finetune="full")
        policy = Policy(spec, learning_rate=1e-3, seed=0)
        key = user_key()
        server, port = await create_rollout(RolloutSettings(credential=key, device="cpu"))
        address = f"127.0.0.1:{port}"
        sent, diffs = [], []
        try:
            async with aio_channel(address, credential=key) as channel:
                # The gRPC path (same host, "auto" would take shared memory:
                # test_weight_transport.py).
                rollout = GrpcRolloutSession(channel, address=address, weight_transport="grpc")
                send = rollout._send
                names: set[str] = set()

                async def counting_send(request, timeout_s):  # noqa: ANN001, ANN202
                    names.update(t.name for t in request.weights.tensors)  # what travels
                    await send(request, timeout_s)

                rollout._send = counting_send  # type: ignore[method-assign]
                model = to_proto(JobSpec(kind="session", model=spec)).model
                await rollout.open_sampling_only(job_id="j", model=model, seed=0, timeout_s=60)
                for version in (1, 2):
                    with torch.no_grad():
                        policy.model.get_decoder().norm.weight.mul_(1.5)  # one tensor changes
                    names.clear()
                    result = await verified_sync(
                        rollout, policy, version=version, tolerance=None, timeout_s=60
                    )
                    sent.append(len(names))
                    diffs.append(result.probe_diff)
        finally:
            await server.stop(grace=0.5)
        return sent, diffs

    sent, diffs = asyncio.run(main())
    trainable = 26  # the tiny Qwen2's parameters (tied head): all travel the first time
    assert sent == [trainable, 1]
    assert all(diff <= 1e-3 for diff in diffs), diffs


@pytest.mark.integration
def test_score_tokens_refuses_ids_outside_the_vocabulary_by_name(tmp_path) -> None:
    """The rollout's ScoreTokens (prompt logprobs) checks ids as SampleTokens does: an id the
    model has no embedding for is the caller's INVALID_ARGUMENT, not an index error."""

    async def main() -> None:
        async with session_rollout(ensure_tiny_model(tmp_path / "tiny-qwen2")) as stub:
            good = await stub.ScoreTokens(
                rollout_pb2.ScoreTokensRequest(token_ids=[1, 2, 3]), timeout=30
            )
            assert len(good.logprobs) == 2 and all(lp < 0 for lp in good.logprobs)
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stub.ScoreTokens(
                    rollout_pb2.ScoreTokensRequest(token_ids=[1, 10**6]), timeout=30
                )
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "token_ids has ids outside the vocabulary" in bad.value.details()

    asyncio.run(main())
