"""How one Rollout stream's weight updates travel: gRPC inline bytes, a shared-memory ring, or
CUDA IPC handles (protos/opentinker/rollout/v1/rollout.proto: WeightTransport).

The trainer offers the same-host paths at OpenRollout (``StreamTransport.offer``); the rollout
tries them and answers which it takes; each update then picks the best one its tensors allow:
CUDA IPC for CUDA tensors on the offered GPU, shared memory for the rest, inline otherwise.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

import structlog
import torch

from opentinker.rollout.v1 import rollout_pb2
from opentinker.services.modeling import cuda_ipc
from opentinker.services.modeling.shared_weights import (
    ProbeOffer,
    SegmentWriter,
    plan_buckets,
    region_bytes,
)
from opentinker.services.modeling.weights import DEFAULT_CHUNK_BYTES

log = structlog.get_logger("opentinker.trainer.weight_transport")

# "auto": offer shared memory (and CUDA IPC from a GPU), take what the rollout accepts;
# "grpc": inline bytes only.
TransportSetting = Literal["auto", "grpc"]
Send = Callable[[rollout_pb2.RolloutRequest], Awaitable[int]]  # returns the request's seq
Receive = Callable[[], Awaitable[rollout_pb2.RolloutResponse]]  # the next taken/applied

CUDA_IPC_TENSORS_PER_CHUNK = 256  # handles are ~200 bytes: a chunk stays small


class StreamTransport:
    """The transport state of one stream: the offer, what the rollout took, the ring."""

    def __init__(self, setting: TransportSetting, *, bucket_bytes: int = DEFAULT_CHUNK_BYTES):
        self.setting = setting
        self.bucket_bytes = bucket_bytes
        self.accepted: frozenset[int] = frozenset({rollout_pb2.WEIGHT_TRANSPORT_INLINE})
        self._probe: ProbeOffer | None = None
        self._cuda_uuid = ""
        self._writer = SegmentWriter()

    def offer(self) -> rollout_pb2.WeightTransportOffer | None:
        """The offer for an OpenRollout (None: gRPC only); a new stream forgets the old."""
        self.close()
        if self.setting == "grpc":
            return None
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # a GPU policy here
            self._cuda_uuid = cuda_ipc.device_uuid(
                torch.device("cuda", torch.cuda.current_device())
            )
        self._probe = ProbeOffer(self._cuda_uuid)
        return self._probe.offer

    def opened(self, reply: rollout_pb2.RolloutOpened | None) -> None:
        """The rollout answered the open (None: it failed): the probe goes, the answer stays."""
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        if reply is None:
            return
        self.accepted = frozenset(reply.weight_transports) | {rollout_pb2.WEIGHT_TRANSPORT_INLINE}
        if self.setting != "grpc":
            log.info(
                "weight_transport",
                accepted=[rollout_pb2.WeightTransport.Name(t) for t in sorted(self.accepted)],
                refused=reply.weight_transport_detail or None,
            )

    def pick(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """The transport for an update of ``tensors``."""
        values = list(tensors.values())
        if (
            values
            and rollout_pb2.WEIGHT_TRANSPORT_CUDA_IPC in self.accepted
            and all(t.is_cuda for t in values)
            and {cuda_ipc.device_uuid(t.device) for t in values} == {self._cuda_uuid}
        ):
            return rollout_pb2.WEIGHT_TRANSPORT_CUDA_IPC
        if values and rollout_pb2.WEIGHT_TRANSPORT_SHARED_MEMORY in self.accepted:
            capacity = plan_buckets(tensors, self.bucket_bytes)[1]
            if self._writer.fits(capacity):
                return rollout_pb2.WEIGHT_TRANSPORT_SHARED_MEMORY
            log.warning(
                "shared_memory_full",
                needed_mib=round(capacity / 2**20),
                fix="give the node a larger /dev/shm (compose: shm_size)",
            )
        return rollout_pb2.WEIGHT_TRANSPORT_INLINE

    async def send_shared(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        header: rollout_pb2.WeightChunk,
        send: Send,
        receive_taken: Callable[[], Awaitable[rollout_pb2.WeightChunkTaken]],
    ) -> None:
        """Write ``tensors`` bucket by bucket into the ring and send a chunk per bucket,
        waiting for the rollout to release a region before it is written again. Returns once
        the last chunk is sent (its answer is WeightsApplied: then call ``update_done``).
        ``header``: the update's policy_version, is_adapter and probe_token_ids."""
        buckets, capacity = plan_buckets(tensors, self.bucket_bytes)
        writer = self._writer
        try:
            writer.ensure(capacity)
            for index, bucket in enumerate(buckets):
                while (start := writer.reserve(region_bytes(bucket))) is None:
                    writer.taken((await receive_taken()).request_seq)
                described, end = writer.write(bucket, start)
                chunk = _part(
                    header, index == len(buckets) - 1, segment=writer.name, shared=described
                )
                writer.sent(await send(rollout_pb2.RolloutRequest(weights=chunk)), start, end)
        except BaseException:
            writer.close()  # the rollout's answers are unknown now: a fresh segment next time
            raise

    def taken(self, request_seq: int) -> None:
        self._writer.taken(request_seq)

    def update_done(self, path: int, ok: bool) -> None:
        """An update over ``path`` is answered (ok) or failed: release or drop the ring; after
        CUDA IPC, let torch free its records of what the rollout has released."""
        if path == rollout_pb2.WEIGHT_TRANSPORT_SHARED_MEMORY:
            if ok:
                self._writer.all_taken()
            else:
                self._writer.close()
        elif path == rollout_pb2.WEIGHT_TRANSPORT_CUDA_IPC:
            torch.cuda.ipc_collect()

    async def send_cuda_ipc(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        header: rollout_pb2.WeightChunk,
        send: Send,
    ) -> None:
        """Send handles of ``tensors`` (no copy); the caller keeps them unchanged until the
        rollout answers the update."""
        torch.cuda.synchronize()  # the optimizer's writes are done before the rollout reads
        items = list(tensors.items())
        for start in range(0, len(items), CUDA_IPC_TENSORS_PER_CHUNK):
            part = dict(items[start : start + CUDA_IPC_TENSORS_PER_CHUNK])
            last = start + CUDA_IPC_TENSORS_PER_CHUNK >= len(items)
            chunk = _part(header, last, cuda_ipc=cuda_ipc.describe_all(part))
            await send(rollout_pb2.RolloutRequest(weights=chunk))

    def close(self) -> None:
        """The stream ends: unlink and unmap everything it made."""
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        self._writer.close()


def _part(header: rollout_pb2.WeightChunk, last: bool, **payload: Any) -> rollout_pb2.WeightChunk:
    """A chunk of the update ``header`` describes (version, adapter or not, probe ids: these
    only on the last chunk) carrying ``payload``."""
    chunk = rollout_pb2.WeightChunk(
        policy_version=header.policy_version, is_adapter=header.is_adapter, last=last, **payload
    )
    if last:
        chunk.probe_token_ids.extend(header.probe_token_ids)
    return chunk
