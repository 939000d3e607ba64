"""Same-host weight updates, the pieces that need no rollout server: the ring of shared-memory
regions (shared_weights.py), the room check before anything is written to /dev/shm, and what a
rollout accepts of a trainer's offer (weight_transports.accept_offer, cuda_ipc.py). Through a
real rollout server: test_weight_transport.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opentinker.rollout.v1 import rollout_pb2
from opentinker.services.modeling.shared_weights import SegmentWriter

SHM = rollout_pb2.WEIGHT_TRANSPORT_SHARED_MEMORY


def shm_exists(name: str) -> bool:
    return Path("/dev/shm", name).exists()


def test_the_ring_reuses_released_regions_and_waits_for_the_oldest() -> None:
    writer = SegmentWriter()
    try:
        writer.ensure(1024)
        assert shm_exists(writer.name)
        assert writer.reserve(512) == 0
        writer.sent(1, 0, 512)
        assert writer.reserve(512) == 512
        writer.sent(2, 512, 1024)
        assert writer.reserve(64) is None  # full: wait for the rollout
        with pytest.raises(ValueError, match="answered chunk 2, expected 1"):
            writer.taken(2)
        writer.taken(1)  # the first answer: the name goes, the mapping stays
        assert not shm_exists(writer.name)
        assert writer.reserve(256) == 0  # wraps into the released region
        writer.sent(3, 0, 256)
        assert writer.reserve(512) is None  # [256, 512) is too small, 512.. still in flight
        with pytest.raises(ValueError, match="does not fit"):
            writer.reserve(2048)
    finally:
        writer.close()


def test_cuda_ipc_is_refused_with_the_reason_when_the_gpu_is_not_visible() -> None:
    """A rollout that maps the probe but does not see the trainer's GPU takes shared memory
    only and says why; a handle of a GPU it does not see is refused by name."""
    from opentinker.services.modeling import cuda_ipc
    from opentinker.services.modeling.shared_weights import ProbeOffer
    from opentinker.services.rollout.engines.weight_transports import accept_offer

    probe = ProbeOffer(cuda_device_uuid="GPU-0000-not-here")
    try:
        accepted, refused = accept_offer(probe.offer)
    finally:
        probe.close()
    assert accepted == [rollout_pb2.WEIGHT_TRANSPORT_INLINE, SHM]
    assert "GPU-0000-not-here is not visible here" in refused
    assert not shm_exists(probe.offer.probe_segment)
    probe = ProbeOffer(cuda_device_uuid="GPU-0000-not-here")
    try:  # vLLM over two GPUs: its second worker would open the handles across devices
        accepted, refused = accept_offer(probe.offer, engine_gpus=2)
    finally:
        probe.close()
    assert accepted == [rollout_pb2.WEIGHT_TRANSPORT_INLINE, SHM]
    assert "spans 2 GPUs (tensor parallel)" in refused
    with pytest.raises(ValueError, match="'w' lives on GPU GPU-0000-not-here"):
        cuda_ipc.open_tensor(rollout_pb2.CudaIpcTensor(name="w", device_uuid="GPU-0000-not-here"))
    with pytest.raises(ValueError, match="'w' is on cpu, not a CUDA device"):
        cuda_ipc.describe("w", torch.zeros(2))


def test_an_update_larger_than_the_free_dev_shm_is_not_put_there() -> None:
    """Writing past a full tmpfs would kill the trainer (SIGBUS): the ring checks the room
    first, and the update then goes inline (StreamTransport.pick)."""
    from opentinker.services.modeling.shared_weights import shm_room

    writer = SegmentWriter()
    assert shm_room(4096) and writer.fits(4096)
    assert not shm_room(1 << 62) and not writer.fits(1 << 62)
