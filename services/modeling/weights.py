"""Pack named torch tensors into ``WeightChunk`` messages and put them back together.

A weight update is a stream of chunks (buckets), each at most ``max_chunk_bytes`` of tensor
data; a tensor larger than that is split into byte ranges (``Tensor.byte_offset``/
``total_bytes``), its pieces consecutive in the stream. Tensors travel as raw little-endian
bytes in their own dtype: no text, no re-encoding.

Memory: the sender copies one bucket at a time out of the live tensors (never a whole tensor,
never the model); the receiver (``WeightStream``) hands each tensor on as soon as its last
piece is in, so it buffers at most one tensor. An update names only the tensors it changes
(``ChangedTensors``): the others keep the values the rollout already serves.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from opentinker.common.v1 import common_pb2
from opentinker.rollout.v1 import rollout_pb2

DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024

_TO_PB: dict[torch.dtype, common_pb2.DType] = {
    torch.float32: common_pb2.D_TYPE_FLOAT32,
    torch.float16: common_pb2.D_TYPE_FLOAT16,
    torch.bfloat16: common_pb2.D_TYPE_BFLOAT16,
    torch.int64: common_pb2.D_TYPE_INT64,
}
_FROM_PB = {v: k for k, v in _TO_PB.items()}


def dtype_to_pb(name: str, dtype: torch.dtype) -> common_pb2.DType:
    """The wire DType of tensor ``name``'s dtype; TypeError when it cannot travel."""
    if dtype not in _TO_PB:
        raise TypeError(f"tensor {name!r} has dtype {dtype}, which cannot be sent")
    return _TO_PB[dtype]


def dtype_from_pb(name: str, dtype: common_pb2.DType) -> torch.dtype:
    """The torch dtype of a wire DType; ValueError naming the tensor for an unknown one."""
    if dtype not in _FROM_PB:
        raise ValueError(f"tensor {name!r} has an unknown dtype {dtype}")
    return _FROM_PB[dtype]


def _bytes_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor on its own device, without a copy when it is
    contiguous (a parameter always is)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def pack_weights(
    tensors: Mapping[str, torch.Tensor],
    *,
    policy_version: int,
    is_adapter: bool,
    probe_token_ids: list[int] | None = None,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[rollout_pb2.WeightChunk]:
    """Yield the chunks of one weight update, lazily: a chunk's bytes are copied out of the
    tensors (moved to CPU a piece at a time) only when it is asked for. The last chunk has
    ``last=True`` and the probe ids."""
    pending: list[common_pb2.Tensor] = []
    pending_bytes = 0

    def chunk(last: bool) -> rollout_pb2.WeightChunk:
        return rollout_pb2.WeightChunk(
            policy_version=policy_version,
            is_adapter=is_adapter,
            tensors=pending,
            last=last,
            probe_token_ids=(probe_token_ids or []) if last else [],
        )

    for name, tensor in tensors.items():
        dtype = dtype_to_pb(name, tensor.dtype)
        raw = _bytes_view(tensor)
        total = raw.numel()
        for offset in range(0, max(total, 1), max_chunk_bytes):
            size = min(max_chunk_bytes, total - offset)
            if pending and pending_bytes + size > max_chunk_bytes:
                yield chunk(last=False)
                pending, pending_bytes = [], 0
            piece = raw[offset : offset + size].cpu().numpy().tobytes()  # one bucket's copy
            pending.append(
                common_pb2.Tensor(
                    name=name,
                    shape=list(tensor.shape),
                    dtype=dtype,
                    data=piece,
                    byte_offset=offset,
                    total_bytes=total,
                )
            )
            pending_bytes += size
    yield chunk(last=True)


@dataclass
class _Partial:
    """A tensor whose pieces are still arriving."""

    buffer: bytearray
    shape: list[int]
    dtype: common_pb2.DType
    filled: int = 0


@dataclass
class WeightStream:
    """Receives one update chunk by chunk. ``add`` returns the tensors that a chunk completed
    (to be applied at once); only a tensor still missing pieces is buffered, so the receiver
    never holds a second copy of the model. Pieces of a tensor must come consecutively, as
    ``pack_weights`` sends them; ``add`` raises ValueError for anything malformed."""

    policy_version: int | None = None
    tensors_received: int = 0
    _partial: dict[str, _Partial] = field(default_factory=dict)

    def add(self, chunk: rollout_pb2.WeightChunk) -> dict[str, torch.Tensor]:
        if self.policy_version is None:
            self.policy_version = chunk.policy_version
        elif chunk.policy_version != self.policy_version:
            raise ValueError(
                f"weight chunk for version {chunk.policy_version} arrived while version "
                f"{self.policy_version} was incomplete"
            )
        done: dict[str, torch.Tensor] = {}
        for piece in chunk.tensors:
            name = piece.name
            if piece.dtype not in _FROM_PB:
                raise ValueError(f"tensor {name!r} has an unknown dtype {piece.dtype}")
            partial = self._partial.get(name)
            if partial is None:
                if self._partial:
                    raise ValueError(
                        f"tensor {name!r} started before tensor {next(iter(self._partial))!r} "
                        f"was complete; send a tensor's pieces consecutively"
                    )
                partial = _Partial(bytearray(piece.total_bytes), list(piece.shape), piece.dtype)
                self._partial[name] = partial
            end = piece.byte_offset + len(piece.data)
            if end > len(partial.buffer):
                raise ValueError(f"tensor {name!r}: piece runs past its total_bytes")
            partial.buffer[piece.byte_offset : end] = piece.data
            partial.filled += len(piece.data)
            if partial.filled == len(partial.buffer):
                done[name] = _tensor_of(self._partial.pop(name))
                self.tensors_received += 1
        if chunk.last and self._partial:
            name, partial = next(iter(self._partial.items()))
            raise ValueError(
                f"tensor {name!r} is incomplete: {partial.filled}/{len(partial.buffer)} bytes"
            )
        return done


def _tensor_of(partial: _Partial) -> torch.Tensor:
    """The finished tensor, sharing the buffer's memory (no copy)."""
    if not partial.buffer:
        flat = torch.empty(0, dtype=torch.uint8)
    else:
        flat = torch.frombuffer(partial.buffer, dtype=torch.uint8)
    return flat.view(_FROM_PB[partial.dtype]).reshape(partial.shape)


# name -> (the tensor, its storage address, its version counter). The tensor itself is kept:
# while it lives its address cannot be handed to a new tensor, so a fresh tensor (a gathered
# copy, say) always counts as changed instead of passing for the old one by address reuse.
Stamps = dict[str, tuple[torch.Tensor, int, int]]


class ChangedTensors:
    """Which tensors changed since the last update the rollout acknowledged.

    torch bumps a tensor's version counter on every in-place write (``optimizer.step``,
    ``load_state_dict``, ``copy_``) and ``detach()`` shares it, so comparing (storage
    address, version) finds what changed without keeping a copy or hashing a byte. A tensor
    never sent, or replaced by another storage, counts as changed. The stamped tensors are
    held (views of the live parameters: no memory of their own) so an address is never
    reused while it is remembered.
    """

    def __init__(self) -> None:
        self._served: Stamps = {}

    def changed(
        self, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], Stamps]:
        """(the tensors to send, the stamps of all ``tensors`` as they are now). Until
        ``acknowledge(stamps)``, everything counts as changed: an update that failed half
        way left the rollout with weights nobody knows."""
        stamps = {name: (t, t.data_ptr(), t._version) for name, t in tensors.items()}
        served, self._served = self._served, {}
        return {n: t for n, t in tensors.items() if not _same(served.get(n), stamps[n])}, stamps

    def acknowledge(self, stamps: Stamps) -> None:
        """The rollout now serves the tensors as they were when ``changed`` stamped them."""
        self._served = dict(stamps)

    def forget(self) -> None:
        """A new rollout: the next update sends every tensor."""
        self._served = {}


def _same(before: tuple[torch.Tensor, int, int] | None, now: tuple[torch.Tensor, int, int]) -> bool:
    return before is not None and before[1:] == now[1:]
