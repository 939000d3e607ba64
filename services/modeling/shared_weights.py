"""Weight updates through POSIX shared memory, for a trainer and a rollout on one host.

The trainer owns one segment per Rollout stream (``SegmentWriter``) and uses it as a ring:
each bucket of changed tensors is copied straight from the live parameters into a free part
of it, the chunk naming those byte ranges is sent over gRPC, and that part is written again
only after the rollout has answered the chunk. The rollout (``SegmentReader``) maps the
segment once and hands zero-copy views of it to its engine, which copies them into its
weights. One copy on each side, no bytes in the gRPC messages, and the extra memory is the
segment: max(2 buckets, the largest tensor).

No leak in /dev/shm: the trainer unlinks the segment's name as soon as the rollout has answered
its first chunk (both keep their mapping; the memory goes with the last one), and on any error
or close; a trainer killed in between is covered by Python's resource tracker, which unlinks
what its process created. The rollout never registers what it maps (see ``attach_segment``).
The trainer offers the path with a probe segment at OpenRollout (``ProbeOffer``); a rollout that
cannot map it (another host, another IPC namespace) says so, and the stream stays on gRPC.
"""

from __future__ import annotations

import mmap
import os
import secrets
import shutil
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory

import torch

from opentinker.rollout.v1 import rollout_pb2
from opentinker.services.modeling.weights import dtype_from_pb, dtype_to_pb

SEGMENT_PREFIX = "otw_"  # every segment this module creates: /dev/shm/otw_<hex>
ALIGN = 64  # each tensor's offset in a segment: any dtype's view is aligned


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def region_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """The bytes ``SegmentWriter.write`` takes for ``tensors`` (each aligned)."""
    return sum(_aligned(_nbytes(t)) for t in tensors.values())


def shm_room(size: int, *, directory: str = "/dev/shm") -> bool:
    """Whether ``directory`` (the tmpfs behind POSIX shared memory on Linux) has ``size``
    bytes free: a segment is sparse until written, and writing past a full tmpfs kills the
    writer with SIGBUS (a container's default /dev/shm is 64 MB). True where it cannot tell."""
    try:
        return shutil.disk_usage(directory).free >= size
    except OSError:
        return True


def create_segment(size: int) -> SharedMemory:
    """A new segment of ``size`` bytes named ``otw_<random>`` (registered with Python's
    resource tracker: unlinked if this process dies before unlinking it itself)."""
    while True:
        try:
            return SharedMemory(SEGMENT_PREFIX + secrets.token_hex(8), create=True, size=size)
        except FileExistsError:
            continue


class MappedSegment:
    """Someone else's segment, mapped read-write: ``buf`` until ``close``."""

    def __init__(self, name: str) -> None:
        # Not SharedMemory(name): before Python 3.13 (track=False) attaching registers the
        # segment with this process's resource tracker, which would unlink the trainer's
        # segment when the rollout exits (bpo-39959). The same calls, without that.
        import _posixshmem

        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            self._mmap: mmap.mmap | None = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.name = name
        self.size = len(self._mmap)

    def tensor(self) -> torch.Tensor:
        """The whole segment as uint8 (no copy; valid until ``close``)."""
        assert self._mmap is not None, "segment closed"
        return torch.frombuffer(self._mmap, dtype=torch.uint8)

    def close(self) -> None:
        """Drop this mapping. Not ``mmap.close()``: a view handed out may still be read by an
        engine thread (a cancelled stream does not stop it), and torch's views keep the mmap
        object alive but hold no buffer export. The pages are unmapped when the last view
        goes."""
        self._mmap = None


def attach_segment(name: str) -> MappedSegment:
    """Map the segment ``name`` (OSError when it is not there: another host or namespace)."""
    if not name.startswith(SEGMENT_PREFIX) or "/" in name:
        raise ValueError(f"shared-memory segment name {name!r} is not one of the trainer's")
    return MappedSegment(name)


class ProbeOffer:
    """The trainer's offer at OpenRollout: a one-page segment holding a random nonce."""

    def __init__(self, cuda_device_uuid: str = "") -> None:
        segment = create_segment(mmap.PAGESIZE)
        self._segment: SharedMemory | None = segment
        self.nonce = secrets.token_bytes(16)
        assert segment.buf is not None  # None only once closed
        segment.buf[: len(self.nonce)] = self.nonce
        self.offer = rollout_pb2.WeightTransportOffer(
            probe_segment=self._segment.name,
            probe_nonce=self.nonce,
            cuda_device_uuid=cuda_device_uuid,
        )

    def close(self) -> None:
        """Unlink and unmap the probe (after RolloutOpened, or on failure)."""
        if self._segment is not None:
            segment, self._segment = self._segment, None
            segment.close()
            segment.unlink()


def check_probe(offer: rollout_pb2.WeightTransportOffer) -> str:
    """'' when this process maps the offer's probe segment and reads its nonce; else why not."""
    try:
        segment = attach_segment(offer.probe_segment)
    except (OSError, ValueError) as err:
        return f"cannot map the trainer's shared-memory segment {offer.probe_segment!r}: {err}"
    try:
        seen = bytes(segment.tensor()[: len(offer.probe_nonce)].numpy())
    finally:
        segment.close()
    if seen != offer.probe_nonce:
        return f"shared-memory segment {offer.probe_segment!r} holds another nonce"
    return ""


@dataclass(frozen=True)
class _Region:
    request_seq: int
    start: int
    end: int


class SegmentWriter:
    """The trainer's ring segment of one stream (see the module docstring)."""

    def __init__(self) -> None:
        self._segment: SharedMemory | None = None
        self._base: torch.Tensor | None = None
        self._linked = False  # the name still exists in /dev/shm
        self._head = 0
        self._inflight: deque[_Region] = deque()

    @property
    def name(self) -> str:
        assert self._segment is not None, "no segment yet"
        return self._segment.name

    @property
    def size(self) -> int:
        """The segment's bytes (0 before the first update)."""
        return self._segment.size if self._segment is not None else 0

    def fits(self, capacity: int) -> bool:
        """Whether ``ensure(capacity)`` keeps the segment or finds room for a new one."""
        return (self._segment is not None and self._segment.size >= capacity) or shm_room(capacity)

    def ensure(self, capacity: int) -> None:
        """A segment of at least ``capacity`` bytes (a new one, empty, when it must grow)."""
        if self._segment is not None and self._segment.size >= capacity:
            return
        assert not self._inflight, "grow the segment only between updates"
        self.close()
        self._segment = create_segment(capacity)
        self._linked = True
        self._base = torch.frombuffer(self._segment.buf, dtype=torch.uint8)
        self._head = 0

    def reserve(self, nbytes: int) -> int | None:
        """The start of ``nbytes`` contiguous free bytes, or None until a chunk is released."""
        assert self._segment is not None
        capacity = self._segment.size
        if nbytes > capacity:
            raise ValueError(f"a {nbytes}-byte bucket does not fit the {capacity}-byte segment")
        if not self._inflight:
            self._head = 0
            return 0
        oldest = self._inflight[0].start
        if self._head > oldest:  # free: [head, capacity) and [0, oldest)
            if self._head + nbytes <= capacity:
                return self._head
            return 0 if nbytes <= oldest else None
        return self._head if self._head + nbytes <= oldest else None

    def write(
        self, tensors: Mapping[str, torch.Tensor], start: int
    ) -> tuple[list[rollout_pb2.SharedTensor], int]:
        """Copy ``tensors`` into the segment from ``start`` (one copy each, from whatever
        device they live on); returns their descriptors and the end of the region."""
        assert self._base is not None
        described, offset = [], start
        for name, tensor in tensors.items():
            n = _nbytes(tensor)
            view = self._base[offset : offset + n].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor.detach())
            described.append(
                rollout_pb2.SharedTensor(
                    name=name,
                    shape=list(tensor.shape),
                    dtype=dtype_to_pb(name, tensor.dtype),
                    offset=offset,
                    nbytes=n,
                )
            )
            offset += _aligned(n)
        return described, offset

    def sent(self, request_seq: int, start: int, end: int) -> None:
        self._inflight.append(_Region(request_seq, start, end))
        self._head = end

    def taken(self, request_seq: int) -> None:
        """The rollout answered the oldest chunk in flight: its region is free; the name goes
        once the rollout has mapped the segment."""
        if not self._inflight or self._inflight[0].request_seq != request_seq:
            expected = self._inflight[0].request_seq if self._inflight else None
            raise ValueError(f"rollout answered chunk {request_seq}, expected {expected}")
        self._inflight.popleft()
        self.unlink()

    def all_taken(self) -> None:
        """The update is answered (WeightsApplied): nothing is in flight any more."""
        self._inflight.clear()
        self.unlink()

    def unlink(self) -> None:
        if self._segment is not None and self._linked:
            self._linked = False
            self._segment.unlink()

    def close(self) -> None:
        """Unlink (if not yet) and unmap: after a failed update, or with the stream."""
        self.unlink()
        self._inflight.clear()
        if self._segment is not None:
            self._base = None
            self._segment.close()
            self._segment = None


def plan_buckets(
    tensors: Mapping[str, torch.Tensor], bucket_bytes: int
) -> tuple[list[dict[str, torch.Tensor]], int]:
    """Tensors grouped into buckets of at most ``bucket_bytes`` (aligned; a larger tensor is a
    bucket of its own), in order, and the segment capacity they need: max(two buckets, the
    largest bucket), so one bucket is written while the rollout copies the previous one."""
    buckets: list[dict[str, torch.Tensor]] = []
    sizes: list[int] = []
    for name, tensor in tensors.items():
        n = _aligned(_nbytes(tensor))
        if buckets and sizes[-1] + n <= bucket_bytes:
            buckets[-1][name] = tensor
            sizes[-1] += n
        else:
            buckets.append({name: tensor})
            sizes.append(n)
    return buckets, max([2 * bucket_bytes, *sizes])


class SegmentReader:
    """The rollout's side: the segment the trainer's chunks name, mapped once per stream."""

    def __init__(self) -> None:
        self._segment: MappedSegment | None = None

    def views(self, chunk: rollout_pb2.WeightChunk) -> dict[str, torch.Tensor]:
        """Zero-copy views of the chunk's shared tensors (valid until the next chunk names
        another segment, or ``close``). OSError when the segment cannot be mapped, ValueError
        for a descriptor outside it."""
        if not chunk.shared:
            return {}
        if self._segment is None or self._segment.name != chunk.segment:
            self.close()
            self._segment = attach_segment(chunk.segment)
        base = self._segment.tensor()
        views = {}
        for d in chunk.shared:
            dtype = dtype_from_pb(d.name, d.dtype)
            numel = 1
            for size in d.shape:
                numel *= size
            itemsize = torch.empty(0, dtype=dtype).element_size()
            if d.nbytes != numel * itemsize or d.offset % ALIGN or d.offset < 0:
                raise ValueError(f"tensor {d.name!r}: bad shared-memory descriptor {d.offset=}")
            if d.offset + d.nbytes > self._segment.size:
                raise ValueError(f"tensor {d.name!r} runs past segment {chunk.segment!r}")
            views[d.name] = base[d.offset : d.offset + d.nbytes].view(dtype).view(list(d.shape))
        return views

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None
