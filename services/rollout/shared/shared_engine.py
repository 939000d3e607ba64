"""The jobs of one shared engine: who holds which adapter, and each job's engine view.

``SharedAdapters`` admits up to ``capacity`` LoRA jobs of its base model onto one
``MixedLoraEngine``; each gets an ``AdapterEngine``, which is a plain ``GenerationEngine`` to
the rollout session and agent loop (engine.py), so they run unchanged on a shared engine.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from opentinker.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from opentinker.services.rollout.agent.seeds import derive_seed
from opentinker.services.rollout.config import RolloutConfig
from opentinker.services.rollout.engines.multi_lora import (
    LoraRow,
    MixedLoraEngine,
    adapter_name_for,
)
from opentinker.services.rollout.shared.batcher import MixedBatcher
from opentinker.services.rollout.types import Completion
from opentinker.spec import ModelSpec, SamplingParams


class AdapterEngine:
    """One job's adapter on a shared engine, seen as a ``GenerationEngine``.

    generate: the job's rows, seeded per row from the call's seed (``derive_seed(seed, "row",
    i)``), go through the shared batcher; apply_weights: only this adapter's tensors;
    logprobs_of: scored with this adapter (the job's weight-sync probe).
    """

    image_processor = None  # text only: vision models keep a private engine

    def __init__(self, batcher: MixedBatcher, adapter: str) -> None:
        self._batcher = batcher
        self._engine: MixedLoraEngine = batcher.engine
        self.adapter = adapter
        self.name = self._engine.name
        self.policy_version = 0
        self.max_model_len = self._engine.max_model_len

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._engine.tokenizer

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        seed: int,
        *,
        greedy: bool = False,
    ) -> list[Completion]:
        rows = [
            LoraRow(p, self.adapter, sampling, derive_seed(seed, "row", i), greedy)
            for i, p in enumerate(prompts)
        ]
        return self._batcher.submit(rows)

    def apply_weights(self, tensors: Mapping[str, torch.Tensor], policy_version: int) -> None:
        self._engine.apply_adapter_weights(self.adapter, tensors)
        self.policy_version = policy_version

    def logprobs_of(self, token_ids: Sequence[int]) -> list[float]:
        return self._engine.adapter_logprobs_of(self.adapter, token_ids)

    def top_logprobs_of(self, token_ids: Sequence[int], k: int) -> tuple[list[int], list[float]]:
        """This adapter's top-k next tokens (top_logprobs.py), on the engine that has them."""
        top = getattr(self._engine, "adapter_top_logprobs_of", None)  # an optional capability
        if top is None:
            raise InvalidArgumentError(
                "top_k: top-k logprobs are not served by this shared vLLM engine yet (the "
                "transformers engines serve them); leave it 0"
            )
        return top(self.adapter, token_ids, k)

    def keep_prefixes(self, capacity_bytes: int) -> None:
        """As ``TransformersEngine.keep_prefixes``, for this adapter's rows (vLLM's engine
        keeps prefixes itself, and has no such call)."""
        keep = getattr(self._engine, "keep_prefixes", None)
        if keep is not None:
            keep(self.adapter, capacity_bytes)


class SharedAdapters:
    """The LoRA jobs on one shared engine (at most ``capacity`` at once)."""

    def __init__(self, batcher: MixedBatcher, *, capacity: int) -> None:
        self.batcher = batcher
        self.engine = batcher.engine
        self.capacity = capacity
        self._jobs: dict[str, AdapterEngine] = {}
        self._lock = threading.Lock()
        batcher.company = lambda: len(self._jobs)  # a call waits only for jobs that are here

    @property
    def jobs(self) -> list[str]:
        with self._lock:
            return list(self._jobs)

    def attach(self, job_id: str, spec: ModelSpec) -> AdapterEngine:
        """Load a fresh adapter for ``job_id`` (ValueError when the spec does not fit this
        engine: not LoRA, another base model, an init adapter that does not fit)."""
        with self._lock:
            if job_id in self._jobs:
                raise FailedPreconditionError(
                    f"job {job_id} already has a Rollout stream open on this shared engine; "
                    f"close it first",
                    code="FAILED_PRECONDITION",
                )
            if len(self._jobs) >= self.capacity:
                raise ResourceExhaustedError(
                    f"this shared engine serves {self.capacity} adapters, all in use; "
                    f"give the job a private rollout or raise the capacity",
                    code="RESOURCE_EXHAUSTED",
                )
            adapter = AdapterEngine(self.batcher, adapter_name_for(job_id))
            self._jobs[job_id] = adapter  # held while loading: the capacity counts it
        self.batcher.admit(adapter.adapter)
        try:
            self.engine.add_adapter(adapter.adapter, spec)
        except BaseException:
            with self._lock:
                self._jobs.pop(job_id, None)
            raise
        return adapter

    def detach(self, job_id: str) -> None:
        """Drop the job's adapter (its stream ended); unknown jobs are ignored."""
        with self._lock:
            adapter = self._jobs.pop(job_id, None)
        if adapter is not None:
            # Its calls leave the batcher first: one still waiting there, merged with other
            # jobs' rows after the engine dropped the adapter, would fail theirs too.
            self.batcher.retire(adapter.adapter)
            self.engine.remove_adapter(adapter.adapter)


class Tenancy:
    """What one Rollout stream may do on a shared engine: open its own job's adapter, no
    other. The stream's caller is a job token (checked by the scheduler's IdentityService);
    its OpenRollout must name that job, and its weight updates and probes then reach only
    that job's adapter (``AdapterEngine``)."""

    def __init__(self, shared: SharedAdapters, job_id: str) -> None:
        self.shared = shared
        self.job_id = job_id
        self._attached = False

    def admit(self, config: RolloutConfig) -> None:
        """Refuse an OpenRollout this caller may not make here."""
        if config.job_id != self.job_id:
            raise PermissionDeniedError(
                f"this Rollout stream belongs to job {self.job_id}; it cannot open job "
                f"{config.job_id}",
                code="PERMISSION_DENIED",
            )
        if config.adapter_dir:
            raise InvalidArgumentError(
                "a shared engine serves LoRA training; serving a trained adapter "
                "(adapter_dir) needs a private rollout",
                code="INVALID_ARGUMENT",
            )

    def engine_factory(self, spec: ModelSpec) -> AdapterEngine:
        adapter = self.shared.attach(self.job_id, spec)
        self._attached = True
        return adapter

    def release(self) -> None:
        """The stream ended: free the job's adapter (if it got one)."""
        if self._attached:
            self._attached = False
            self.shared.detach(self.job_id)
