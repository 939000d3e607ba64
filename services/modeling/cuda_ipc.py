"""Weight updates through CUDA IPC: the trainer hands handles of its own GPU tensors, the
rollout opens them and copies on the GPU. No bytes move through the host.

Both directions use torch.multiprocessing's own sharing (``reduce_tensor``, i.e.
``storage._share_cuda_()``, and ``rebuild_cuda_tensor``), its fields carried one by one in a
``CudaIpcTensor`` message instead of a pickle. The trainer's tensors are its live parameters:
they stay valid because the trainer changes none until the rollout has answered the update.
A GPU is named by its UUID, since the two processes may number their visible GPUs differently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from opentinker.rollout.v1 import rollout_pb2
from opentinker.services.modeling.weights import dtype_from_pb, dtype_to_pb


def device_uuid(device: torch.device) -> str:
    """The UUID of a CUDA device, as both processes can name it."""
    return str(torch.cuda.get_device_properties(device).uuid)


def local_device_index(uuid: str) -> int | None:
    """This process's index of the GPU with ``uuid``; None when it does not see it."""
    if not uuid or not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    return None


def describe(name: str, tensor: torch.Tensor) -> rollout_pb2.CudaIpcTensor:
    """A CUDA IPC handle of ``tensor`` (a CUDA tensor; no copy)."""
    if not tensor.is_cuda:
        raise ValueError(f"tensor {name!r} is on {tensor.device}, not a CUDA device")
    _, args = reduce_tensor(tensor.detach())
    (
        _cls,
        size,
        stride,
        storage_offset,
        _storage_cls,
        dtype,
        _device,
        handle,
        storage_size_bytes,
        storage_offset_bytes,
        _requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args
    return rollout_pb2.CudaIpcTensor(
        name=name,
        shape=list(size),
        stride=list(stride),
        storage_offset=storage_offset,
        dtype=dtype_to_pb(name, dtype),
        device_uuid=device_uuid(tensor.device),
        handle=handle,
        storage_size_bytes=storage_size_bytes,
        storage_offset_bytes=storage_offset_bytes,
        ref_counter_handle=ref_counter_handle,
        ref_counter_offset=ref_counter_offset,
        event_handle=event_handle or b"",
        event_sync_required=event_sync_required,
    )


def describe_all(tensors: Mapping[str, torch.Tensor]) -> list[rollout_pb2.CudaIpcTensor]:
    return [describe(name, tensor) for name, tensor in tensors.items()]


def open_tensor(d: rollout_pb2.CudaIpcTensor) -> torch.Tensor:
    """The trainer's tensor ``d`` describes, mapped into this process (valid while the trainer
    keeps it; copy it before answering the update). ValueError when its GPU is not visible."""
    index = local_device_index(d.device_uuid)
    if index is None:
        raise ValueError(
            f"tensor {d.name!r} lives on GPU {d.device_uuid}, which this process does not see "
            f"(CUDA_VISIBLE_DEVICES); use shared memory or gRPC"
        )
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(d.shape),
        tuple(d.stride),
        d.storage_offset,
        torch.storage.TypedStorage,
        dtype_from_pb(d.name, d.dtype),
        index,
        d.handle,
        d.storage_size_bytes,
        d.storage_offset_bytes,
        False,
        d.ref_counter_handle,
        d.ref_counter_offset,
        # bytes, as _share_cuda_() gave them (always 64): torch's C++ _new_shared_cuda checks
        # PyBytes_Check on the event handle before it looks at event_sync_required; None there
        # is an argument error, not "no event".
        bytes(d.event_handle),
        d.event_sync_required,
    )


def open_all(described: list[rollout_pb2.CudaIpcTensor]) -> dict[str, torch.Tensor]:
    return {d.name: open_tensor(d) for d in described}


def meta_tensors(described: Sequence[rollout_pb2.CudaIpcTensor]) -> dict[str, torch.Tensor]:
    """Name -> a meta tensor of each described tensor's shape and dtype: what a weight update
    of these handles would carry, to check against the model before any handle is opened
    (no GPU, no memory). ValueError naming a tensor of an unknown dtype."""
    return {
        d.name: torch.empty(tuple(d.shape), dtype=dtype_from_pb(d.name, d.dtype), device="meta")
        for d in described
    }
