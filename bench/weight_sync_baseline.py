"""The weight-update path before bucketed streaming (commit 1d2fa9d of
services/modeling/weights.py), kept only so bench/weight_sync.py can compare against it.

Sender: each tensor copied whole to bytes, then sliced (a second copy per piece). Receiver:
every tensor of the update buffered until the last chunk, then copied again into the tensors
it returns, which are applied all at once. Not used by any service.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from opentinker.common.v1 import common_pb2
from opentinker.rollout.v1 import rollout_pb2

DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024

_TO_PB = {
    torch.float32: common_pb2.D_TYPE_FLOAT32,
    torch.float16: common_pb2.D_TYPE_FLOAT16,
    torch.bfloat16: common_pb2.D_TYPE_BFLOAT16,
    torch.int64: common_pb2.D_TYPE_INT64,
}
_FROM_PB = {v: k for k, v in _TO_PB.items()}


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def pack_weights(
    tensors: Mapping[str, torch.Tensor],
    *,
    policy_version: int,
    is_adapter: bool,
    probe_token_ids: list[int] | None = None,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[rollout_pb2.WeightChunk]:
    """Yield the chunks of one weight update; the last has ``last=True`` and the probe ids."""
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
        if tensor.dtype not in _TO_PB:
            raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which cannot be sent")
        data = _raw_bytes(tensor)
        for offset in range(0, max(len(data), 1), max_chunk_bytes):
            piece = data[offset : offset + max_chunk_bytes]
            if pending and pending_bytes + len(piece) > max_chunk_bytes:
                yield chunk(last=False)
                pending, pending_bytes = [], 0
            pending.append(
                common_pb2.Tensor(
                    name=name,
                    shape=list(tensor.shape),
                    dtype=_TO_PB[tensor.dtype],
                    data=piece,
                    byte_offset=offset,
                    total_bytes=len(data),
                )
            )
            pending_bytes += len(piece)
    yield chunk(last=True)


class WeightAssembler:
    """Collects chunks of one update; ``add`` returns the finished tensors on the last chunk."""

    def __init__(self) -> None:
        self._buffers: dict[str, bytearray] = {}
        self._meta: dict[str, tuple[list[int], common_pb2.DType]] = {}
        self._filled: dict[str, int] = {}
        self.policy_version: int | None = None

    def add(self, chunk: rollout_pb2.WeightChunk) -> dict[str, torch.Tensor] | None:
        if self.policy_version is None:
            self.policy_version = chunk.policy_version
        elif chunk.policy_version != self.policy_version:
            raise ValueError(
                f"weight chunk for version {chunk.policy_version} arrived while version "
                f"{self.policy_version} was incomplete"
            )
        for t in chunk.tensors:
            if t.dtype not in _FROM_PB:
                raise ValueError(f"tensor {t.name!r} has an unknown dtype {t.dtype}")
            buf = self._buffers.setdefault(t.name, bytearray(t.total_bytes))
            self._meta[t.name] = (list(t.shape), t.dtype)
            if t.byte_offset + len(t.data) > len(buf):
                raise ValueError(f"tensor {t.name!r}: piece runs past its total_bytes")
            buf[t.byte_offset : t.byte_offset + len(t.data)] = t.data
            self._filled[t.name] = self._filled.get(t.name, 0) + len(t.data)
        if not chunk.last:
            return None
        out: dict[str, torch.Tensor] = {}
        for name, buf in self._buffers.items():
            if self._filled[name] != len(buf):
                raise ValueError(
                    f"tensor {name!r} is incomplete: {self._filled[name]}/{len(buf)} bytes"
                )
            shape, dtype = self._meta[name]
            flat = (
                torch.frombuffer(bytearray(buf), dtype=torch.uint8)
                if buf
                else torch.empty(0, dtype=torch.uint8)
            )
            out[name] = flat.view(_FROM_PB[dtype]).reshape(shape).clone()
        WeightAssembler.__init__(self)  # empty again for the next update
        return out
