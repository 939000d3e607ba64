"""The rollout's side of the same-host weight transports (shared memory, CUDA IPC): which it
takes at OpenRollout, and the tensors a chunk names (rollout.proto: WeightTransport).
No gRPC here; service.py turns the errors into RolloutFailed."""

from __future__ import annotations

import structlog
import torch

from opentinker.errors import FailedPreconditionError, InvalidArgumentError
from opentinker.rollout.v1 import rollout_pb2
from opentinker.services.modeling import cuda_ipc
from opentinker.services.modeling.shared_weights import SegmentReader, check_probe

log = structlog.get_logger("opentinker.rollout.weight_transports")


def accept_offer(
    offer: rollout_pb2.WeightTransportOffer, *, engine_gpus: int = 1
) -> tuple[list[rollout_pb2.WeightTransport], str]:
    """(the transports this process takes, why it refused what it did): shared memory when it
    maps the trainer's probe segment, CUDA IPC when it also sees the trainer's GPU and the
    engine runs on one GPU (``engine_gpus``: vLLM's tensor parallel size; its workers on
    other GPUs would have to open the trainer's handles across devices, never tried)."""
    accepted = [rollout_pb2.WEIGHT_TRANSPORT_INLINE]
    if not offer.probe_segment:
        return accepted, ""
    refused = check_probe(offer)
    if refused:
        log.info("shared_memory_refused", reason=refused)
        return accepted, refused
    accepted.append(rollout_pb2.WEIGHT_TRANSPORT_SHARED_MEMORY)
    if offer.cuda_device_uuid:
        if engine_gpus > 1:
            refused = f"CUDA IPC: the engine spans {engine_gpus} GPUs (tensor parallel)"
        elif cuda_ipc.local_device_index(offer.cuda_device_uuid) is None:
            refused = f"CUDA IPC: GPU {offer.cuda_device_uuid} is not visible here"
        else:
            accepted.append(rollout_pb2.WEIGHT_TRANSPORT_CUDA_IPC)
    return accepted, refused


class IncomingWeights:
    """The shared-memory segment of one stream, mapped once (see shared_weights.py)."""

    def __init__(self) -> None:
        self._reader = SegmentReader()

    def shared(self, chunk: rollout_pb2.WeightChunk) -> dict[str, torch.Tensor]:
        """Zero-copy views of the chunk's shared-memory tensors (copy them before answering
        the chunk). FailedPreconditionError when the segment cannot be mapped, with the fix."""
        try:
            return self._reader.views(chunk)
        except OSError as err:
            raise FailedPreconditionError(
                f"cannot map the trainer's shared-memory segment {chunk.segment!r}: {err}; "
                f"run the trainer with OPENTINKER_TRAINER_WEIGHT_TRANSPORT=grpc",
                code="FAILED_PRECONDITION",
            ) from err
        except ValueError as err:
            raise InvalidArgumentError(f"malformed weight chunk: {err}") from err

    def close(self) -> None:
        self._reader.close()


def open_cuda_ipc(described: list[rollout_pb2.CudaIpcTensor]) -> dict[str, torch.Tensor]:
    """The trainer's CUDA tensors, mapped here; InvalidArgumentError naming what is wrong."""
    try:
        return cuda_ipc.open_all(described)
    except (ValueError, RuntimeError) as err:  # torch raises RuntimeError on a bad handle
        raise InvalidArgumentError(f"cannot open CUDA IPC weights: {err}") from err
