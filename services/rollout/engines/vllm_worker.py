"""Methods mixed into vLLM's GPU worker (``LLM(worker_extension_cls=...)``), called by name
through ``LLM.collective_rpc``: vLLM's supported way to reach the model a worker holds.

Imported by vLLM inside its worker process (or the engine's own process when it runs
in-process); it imports nothing of vLLM itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class WeightUpdateExtension:
    """Full-weight updates in place: the tensors go through the model's own ``load_weights``
    (which knows vLLM's fused layouts: q/k/v into qkv_proj, gate/up into gate_up_proj, and its
    tensor-parallel shards), copied into the parameters that are already on the GPU. Nothing
    is re-read from disk and CUDA graphs stay valid (same storage)."""

    model_runner: Any  # vLLM's model runner, set by its worker (vllm is untyped here)

    def opentinker_load_weights(self, named: Sequence[Sequence[object]]) -> int:
        """``named``: (name, tensor) pairs under Hugging Face names; returns how many."""
        runner = self.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        pairs = [(str(name), tensor) for name, tensor in named]
        model.load_weights(weights=iter(pairs))
        torch.cuda.synchronize()
        return len(pairs)

    def opentinker_load_ipc_weights(self, blobs: Sequence[bytes]) -> int:
        """The same, from the trainer's CUDA IPC handles (serialized ``CudaIpcTensor``s):
        opened on this worker's GPU, read by ``load_weights``, closed again; returns how many."""
        from opentinker.rollout.v1 import rollout_pb2
        from opentinker.services.modeling.cuda_ipc import open_tensor

        described = [rollout_pb2.CudaIpcTensor.FromString(blob) for blob in blobs]
        count = self.opentinker_load_weights([(d.name, open_tensor(d)) for d in described])
        return count
