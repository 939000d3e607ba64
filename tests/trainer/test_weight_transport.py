"""Same-host weight updates: shared memory instead of bytes in the gRPC messages (offered at
OpenRollout, tried by the rollout, gRPC otherwise), no segment left in /dev/shm whoever dies,
and CUDA IPC on a GPU (shared_weights.py, cuda_ipc.py, weight_transport.py). The ring, the
room check and the offer's refusals without a rollout server: test_shared_weights.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from identity_helpers import user_key

from opentinker.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.modeling.shared_weights import SEGMENT_PREFIX
from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.rollout.engines.engine_choice import default_engine_factory
from opentinker.services.rollout.service import create_server as create_rollout
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.services.trainer.errors import RolloutError
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.rollout_link.rollout_client import GrpcRolloutSession
from opentinker.services.trainer.rollout_link.weight_sync import verified_sync
from opentinker.spec import JobSpec, ModelSpec, to_proto

SHM = rollout_pb2.WEIGHT_TRANSPORT_SHARED_MEMORY
TRAINABLE = 26  # the tiny Qwen2's parameters (tied head)


def shm_exists(name: str) -> bool:
    return Path("/dev/shm", name).exists()


class Wire:
    """What the trainer's stream sends: weight tensors inline (and their bytes) or by segment."""

    def __init__(self, rollout: GrpcRolloutSession) -> None:
        self.inline: set[str] = set()
        self.inline_bytes = 0
        self.shared: set[str] = set()
        self.segments: set[str] = set()
        self.cuda_ipc = 0
        self.probe = ""
        send = rollout._send

        async def counting_send(request, timeout_s):  # noqa: ANN001, ANN202
            if request.HasField("open"):
                self.probe = request.open.weight_offer.probe_segment
            w = request.weights
            self.inline.update(t.name for t in w.tensors)
            self.inline_bytes += sum(len(t.data) for t in w.tensors)
            self.shared.update(t.name for t in w.shared)
            self.cuda_ipc += len(w.cuda_ipc)
            if w.segment:
                self.segments.add(w.segment)
            await send(request, timeout_s)

        rollout._send = counting_send  # type: ignore[method-assign]

    def clear(self) -> None:
        self.inline, self.shared, self.inline_bytes = set(), set(), 0


async def _open(rollout: GrpcRolloutSession, model_dir: Path) -> None:
    spec = ModelSpec(base_model=str(model_dir), finetune="full")
    model = to_proto(JobSpec(kind="session", model=spec)).model
    await rollout.open_sampling_only(job_id="j", model=model, seed=0, timeout_s=60)


def _sync_twice(tmp_path: Path, transport: str, bucket_bytes: int):
    """Two verified syncs (every tensor, then the one changed) to an in-process rollout;
    returns the wire counts per sync, the probe diffs, the segments, the transports the
    rollout took, and whether its weights equal the trainer's bit for bit."""

    async def main():
        model_dir = ensure_tiny_model(tmp_path / "tiny-qwen2")
        policy = Policy(
            ModelSpec(base_model=str(model_dir), finetune="full"), learning_rate=1e-3, seed=0
        )
        key = user_key()
        settings = RolloutSettings(credential=key, device="cpu")
        engines = []
        factory = default_engine_factory(settings)

        def recording_factory(spec):  # noqa: ANN001, ANN202
            engines.append(factory(spec))
            return engines[-1]

        server, port = await create_rollout(settings, engine_factory=recording_factory)
        address = f"127.0.0.1:{port}"
        per_sync, diffs = [], []
        try:
            async with aio_channel(address, credential=key) as channel:
                rollout = GrpcRolloutSession(channel, address=address, weight_transport=transport)
                rollout.transport.bucket_bytes = bucket_bytes
                wire = Wire(rollout)
                await _open(rollout, model_dir)
                accepted = set(rollout.transport.accepted)
                for version in (1, 2):
                    with torch.no_grad():
                        policy.model.get_decoder().norm.weight.mul_(1.5)  # one tensor changes
                    wire.clear()
                    result = await verified_sync(
                        rollout, policy, version=version, tolerance=None, timeout_s=60
                    )
                    per_sync.append((len(wire.inline), wire.inline_bytes, len(wire.shared)))
                    diffs.append(result.probe_diff)
                    # The rollout answered: no name is left even while the stream stays open.
                    assert not any(shm_exists(s) for s in wire.segments | {wire.probe} if s)
                served = dict(engines[0].model.named_parameters())
                same = all(torch.equal(served[n], t) for n, t in policy.trainable_state().items())
                await rollout.close(reason="done", timeout_s=10)
        finally:
            await server.stop(grace=0.5)
        return per_sync, diffs, wire.segments | {wire.probe}, accepted, same

    return asyncio.run(main())


@pytest.mark.integration
def test_a_same_host_stream_sends_no_tensor_bytes_over_grpc(tmp_path) -> None:
    """The rollout maps the trainer's probe segment at open, so the updates go through shared
    memory (small buckets: the ring wraps and waits for the rollout's answers): the gRPC
    messages carry no tensor bytes, sync 1 all 26 tensors, sync 2 only the changed one; the
    probe passes (fp32: 1e-3) and the rollout's weights equal the trainer's bit for bit."""
    per_sync, diffs, names, accepted, same = _sync_twice(tmp_path, "auto", bucket_bytes=8192)
    assert SHM in accepted
    assert per_sync == [(0, 0, TRAINABLE), (0, 0, 1)]
    assert all(diff <= 1e-3 for diff in diffs), diffs
    assert same
    assert len(names) == 2 and all(n.startswith(SEGMENT_PREFIX) for n in names)  # probe, ring
    assert not any(shm_exists(n) for n in names)


@pytest.mark.integration
def test_forcing_grpc_sends_the_bytes_inline_as_before(tmp_path) -> None:
    per_sync, diffs, names, accepted, same = _sync_twice(tmp_path, "grpc", bucket_bytes=8192)
    assert accepted == {rollout_pb2.WEIGHT_TRANSPORT_INLINE}
    assert [(n, s) for n, _, s in per_sync] == [(TRAINABLE, 0), (1, 0)]
    assert per_sync[0][1] > 1_000_000  # the whole tiny model's bytes travelled inline
    assert all(diff <= 1e-3 for diff in diffs) and same
    assert names == {""}  # nothing offered, no segment made


@pytest.mark.integration
def test_a_rollout_that_cannot_map_a_segment_refuses_with_the_reason(tmp_path) -> None:
    """At open a probe it cannot map means gRPC (RolloutOpened says why); a chunk naming a
    segment it cannot map fails the stream with FAILED_PRECONDITION and the fix."""

    async def main() -> tuple[rollout_pb2.RolloutOpened, rollout_pb2.RolloutFailed]:
        model_dir = ensure_tiny_model(tmp_path / "tiny-qwen2")
        key = user_key()
        server, port = await create_rollout(RolloutSettings(credential=key, device="cpu"))
        try:
            async with aio_channel(f"127.0.0.1:{port}", credential=key) as channel:
                call = rollout_pb2_grpc.RolloutServiceStub(channel).Rollout()
                model = to_proto(
                    JobSpec(kind="session", model=ModelSpec(base_model=str(model_dir)))
                ).model
                offer = rollout_pb2.WeightTransportOffer(
                    probe_segment=SEGMENT_PREFIX + "gone", probe_nonce=b"x"
                )
                await call.write(
                    rollout_pb2.RolloutRequest(
                        seq=1,
                        open=rollout_pb2.OpenRollout(
                            job_id="j", model=model, sampling_only=True, weight_offer=offer
                        ),
                    )
                )
                opened = (await call.read()).opened
                chunk = rollout_pb2.WeightChunk(
                    policy_version=1,
                    segment=SEGMENT_PREFIX + "gone",
                    shared=[rollout_pb2.SharedTensor(name="w", shape=[1], dtype=1, nbytes=4)],
                )
                await call.write(rollout_pb2.RolloutRequest(seq=2, weights=chunk))
                failed = (await call.read()).failed
                call.cancel()
        finally:
            await server.stop(grace=0.5)
        return opened, failed

    opened, failed = asyncio.run(main())
    assert list(opened.weight_transports) == [rollout_pb2.WEIGHT_TRANSPORT_INLINE]
    assert "cannot map the trainer's shared-memory segment" in opened.weight_transport_detail
    assert failed.code == "FAILED_PRECONDITION"
    assert "OPENTINKER_TRAINER_WEIGHT_TRANSPORT=grpc" in failed.reason


ROLLOUT_PROCESS = textwrap.dedent(
    """
    import asyncio, os, sys
    from opentinker.services.rollout.service import create_server
    from opentinker.services.rollout.settings import RolloutSettings

    async def main():
        settings = RolloutSettings(credential=os.environ["KEY"], device="cpu")
        server, port = await create_server(settings)
        print("PORT", port, flush=True)
        await server.wait_for_termination()

    asyncio.run(main())
    """
)


def _rollout_process(
    prefix: list[str], code: str = ROLLOUT_PROCESS
) -> tuple[subprocess.Popen, str]:
    """A rollout server in its own process (``prefix``: e.g. its own /dev/shm); its address."""
    process = subprocess.Popen(
        [*prefix, sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "KEY": user_key()},
    )
    return process, f"127.0.0.1:{_port_of(process)}"


def _port_of(process: subprocess.Popen) -> str:
    assert process.stdout is not None
    for line in process.stdout:  # structlog writes to stdout too
        if line.startswith("PORT "):
            return line.split()[1]
    raise AssertionError(f"rollout process did not start (exit {process.wait()})")


@pytest.mark.integration
def test_a_rollout_that_dies_mid_update_leaves_no_segment(tmp_path) -> None:
    """The rollout process is killed right after the first shared-memory chunk is sent (before
    it answers, so the segment's name still exists): the sync fails naming the rollout, and
    the trainer unlinks the segment; nothing of the stream is left in /dev/shm."""

    async def main() -> tuple[set[str], str]:
        model_dir = ensure_tiny_model(tmp_path / "tiny-qwen2")
        policy = Policy(
            ModelSpec(base_model=str(model_dir), finetune="full"), learning_rate=1e-3, seed=0
        )
        process, address = _rollout_process([])
        try:
            async with aio_channel(address, credential=user_key()) as channel:
                rollout = GrpcRolloutSession(channel, address=address)
                rollout.transport.bucket_bytes = 8192
                wire = Wire(rollout)
                await _open(rollout, model_dir)
                assert SHM in rollout.transport.accepted
                counting_send = rollout._send

                async def killing_send(request, timeout_s):  # noqa: ANN001, ANN202
                    await counting_send(request, timeout_s)
                    if request.weights.shared:
                        assert shm_exists(request.weights.segment)  # not answered yet
                        process.send_signal(signal.SIGKILL)
                        process.wait()

                rollout._send = killing_send  # type: ignore[method-assign]
                with pytest.raises(RolloutError) as failed:
                    await verified_sync(rollout, policy, version=1, tolerance=None, timeout_s=30)
                await rollout.close(reason="rollout died", timeout_s=5)
        finally:
            process.kill()
            process.wait()
        return wire.segments | {wire.probe}, str(failed.value)

    names, error = asyncio.run(main())
    assert "rollout at 127.0.0.1" in error
    assert len(names) == 2 and not any(shm_exists(n) for n in names)


async def _sync_once(address: str, model_dir: Path, policy: Policy):
    """Open a stream to the rollout at ``address``, one verified sync, close."""
    async with aio_channel(address, credential=user_key()) as channel:
        rollout = GrpcRolloutSession(channel, address=address)
        wire = Wire(rollout)
        await _open(rollout, model_dir)
        result = await verified_sync(rollout, policy, version=1, tolerance=None, timeout_s=120)
        await rollout.close(reason="done", timeout_s=10)
    return rollout, wire, result


@pytest.mark.integration
def test_a_rollout_with_its_own_dev_shm_gets_the_bytes_inline(tmp_path) -> None:
    """Another host, as far as /dev/shm goes: the rollout runs in a mount namespace with a
    /dev/shm of its own (unshare). It cannot map the probe, says so, and the updates travel
    inline; the probe of the verified sync passes."""
    if subprocess.run(["unshare", "-r", "--mount", "true"], capture_output=True).returncode:
        pytest.skip("unshare -r --mount is not permitted here: no separate /dev/shm to test")

    async def main() -> tuple[set[int], int, float]:
        model_dir = ensure_tiny_model(tmp_path / "tiny-qwen2")
        policy = Policy(
            ModelSpec(base_model=str(model_dir), finetune="full"), learning_rate=1e-3, seed=0
        )
        # exec: the rollout replaces the shell, so killing the process kills the rollout (a
        # shell left in between would orphan it, running on after the test)
        script = 'mount -t tmpfs t /dev/shm && exec "$@"'
        own_shm = ["unshare", "-r", "--mount", "sh", "-c", script, "-"]
        process, address = _rollout_process(own_shm)
        try:
            rollout, wire, result = await _sync_once(address, model_dir, policy)
        finally:
            process.kill()
            process.wait()
        return set(rollout.transport.accepted), len(wire.inline), result.probe_diff

    accepted, inline, diff = asyncio.run(main())
    assert accepted == {rollout_pb2.WEIGHT_TRANSPORT_INLINE}
    assert inline == TRAINABLE and diff <= 1e-3


@pytest.mark.gpu
def test_cuda_ipc_hands_handles_and_the_rollout_copies_on_the_gpu(tmp_path) -> None:
    """A GPU trainer and a rollout process on the same GPU: the update carries CUDA IPC
    handles (no bytes inline or in shared memory) and the probe passes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: CUDA IPC shares device memory between processes")

    async def main():
        model_dir = ensure_tiny_model(tmp_path / "tiny-qwen2")
        spec = ModelSpec(base_model=str(model_dir), finetune="full")
        policy = Policy(spec, learning_rate=1e-3, seed=0, device="cuda:0")
        code = ROLLOUT_PROCESS.replace('device="cpu"', 'device="cuda:0", engine="transformers"')
        process, address = _rollout_process([], code)
        try:
            rollout, wire, result = await _sync_once(address, model_dir, policy)
        finally:
            process.kill()
            process.wait()
        return set(rollout.transport.accepted), wire.cuda_ipc, wire, result

    accepted, handles, wire, result = asyncio.run(main())
    assert rollout_pb2.WEIGHT_TRANSPORT_CUDA_IPC in accepted
    assert handles == TRAINABLE and wire.inline_bytes == 0 and not wire.shared
    assert result.probe_diff <= 5e-2


def test_a_trainer_killed_holding_a_segment_leaves_nothing_in_dev_shm() -> None:
    """Between creating a segment and the rollout's first answer only the trainer knows its
    name: killed then (SIGKILL, no cleanup of its own), Python's resource tracker unlinks it."""
    code = (
        "from opentinker.services.modeling.shared_weights import create_segment\n"
        "import time; s = create_segment(1 << 16); print('NAME', s.name, flush=True)\n"
        "time.sleep(60)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    name = process.stdout.readline().split()[1]
    assert shm_exists(name)
    process.send_signal(signal.SIGKILL)
    process.wait()
    for _ in range(300):  # the tracker notices its parent's end (seconds under load)
        if not shm_exists(name):
            break
        time.sleep(0.1)
    assert not shm_exists(name)
