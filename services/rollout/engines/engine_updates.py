"""Weight updates into a rollout's engine: the parts of an update copied in as they come
(inline tensors, shared memory, CUDA IPC handles), then the last part, which serves the new
policy version and proves it with the logprobs of the trainer's probe.

Plain asyncio, as session.py; service.py turns the errors into RolloutFailed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import structlog
import torch

from opentinker.errors import InvalidArgumentError
from opentinker.rollout.v1 import rollout_pb2
from opentinker.services.rollout.engines.engine import GenerationEngine, WeightUpdateError
from opentinker.services.rollout.engines.vllm_engine import VllmEngine
from opentinker.services.rollout.engines.weight_transports import open_cuda_ipc

log = structlog.get_logger("opentinker.rollout.session")  # the session's own events


@dataclass(frozen=True)
class WeightsResult:
    """An update applied: the version served, the probe's logprobs under it, and the seconds
    spent copying the update into the engine (all its parts)."""

    policy_version: int
    probe_logprobs: list[float]
    apply_seconds: float


class EngineUpdates:
    """The weight updates of one engine (a session's, once open), one update at a time."""

    def __init__(self, engine: GenerationEngine) -> None:
        self.engine = engine
        self._loading_seconds = 0.0  # applying the chunks of the update in progress

    async def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy part of a weight update into the served weights; the version stays until
        ``apply`` ends the update."""
        await self._copy_in(tensors, self.engine.policy_version)

    async def load_cuda_ipc(self, described: Sequence[rollout_pb2.CudaIpcTensor]) -> None:
        """Copy the trainer's CUDA tensors (IPC handles) into the served weights; the version
        stays until ``apply``. vLLM (full weights) opens them in its own workers and loads
        them with its in-place ``load_weights``; other engines, and vLLM's LoRA adapters
        (copied to the host for the adapter folder), open them here."""
        engine = self.engine
        if not isinstance(engine, VllmEngine) or engine.adapters is not None:
            tensors = await asyncio.to_thread(open_cuda_ipc, list(described))
            await self._copy_in(tensors, engine.policy_version)
            del tensors
            await asyncio.to_thread(torch.cuda.synchronize)  # copied before the trainer goes on
            return
        started = time.monotonic()
        try:
            await asyncio.to_thread(engine.apply_cuda_ipc, described)
        except WeightUpdateError as err:
            raise InvalidArgumentError(str(err), code="INVALID_ARGUMENT") from err
        self._loading_seconds += time.monotonic() - started

    async def apply(
        self,
        tensors: Mapping[str, torch.Tensor],
        policy_version: int,
        probe_token_ids: Sequence[int],
        *,
        tensors_in_update: int | None = None,
    ) -> WeightsResult:
        """Load the last part of a weight update (all of it, when not streamed), serve
        ``policy_version``, then prove it: logprobs of the probe ids. Tensors not named keep
        their values (the trainer sends only what changed)."""
        await self._copy_in(tensors, policy_version)
        seconds, self._loading_seconds = self._loading_seconds, 0.0
        probe = await asyncio.to_thread(self.engine.logprobs_of, list(probe_token_ids))
        log.info(
            "weights_applied",
            policy_version=policy_version,
            tensors=tensors_in_update if tensors_in_update is not None else len(tensors),
            seconds=seconds,
        )
        return WeightsResult(policy_version, probe, seconds)

    async def _copy_in(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        started = time.monotonic()
        try:
            await asyncio.to_thread(self.engine.apply_weights, tensors, version)
        except WeightUpdateError as err:
            self._loading_seconds = 0.0
            raise InvalidArgumentError(str(err), code="INVALID_ARGUMENT") from err
        self._loading_seconds += time.monotonic() - started
