"""vLLM multi-LoRA: many jobs' adapters on one base model, one ``LLM.generate`` call for all.

``VllmMixedLoraEngine`` implements ``MixedLoraEngine`` (multi_lora.py) on a CUDA GPU, the way
``SharedLoraEngine`` does with peft on CPU:

- each job's adapter is a PEFT folder served under a ``LoRARequest`` of its own; a weight update
  writes a new folder under a new int id (vLLM caches adapters by id, so an id is never reused),
  loads it with ``add_lora`` and removes the job's previous id: the job's next rows run on the
  new version, the other jobs' adapters are not touched;
- ``generate_rows`` is ONE engine call: one request per row with its own ``LoRARequest`` and its
  own seed (vLLM batches rows of different adapters together: punica kernels, up to
  ``max_loras`` adapters in a batch), so a row's tokens depend on its prompt, adapter and seed;
- ``adapter_logprobs_of`` is the job's probe, scored under that job's adapter only;
- ``remove_adapter`` frees the job's slot and folder when its stream ends.

Engine size: ``max_loras`` = the shared engine's capacity (every job's adapter fits in one
batch), ``max_cpu_loras`` = capacity + 1 (the version being switched to beside the others, so
a switch never evicts another job's adapter), ``max_lora_rank`` = vLLM's slot for the largest
rank the engine admits (the worker sends a job of a larger rank to a private rollout).

What needs no GPU is here as plain code tested on CPU (tests/rollout/test_vllm_multi_lora.py): the
adapter table (ids, versions, folders per job), the request of each row, the engine options.
The class at the end only hands them to vLLM (tests/rollout/test_vllm_multi_lora_gpu.py).
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from opentinker.services.rollout.engines.multi_lora import (
    LoraRow,
    check_shared_spec,
    check_text_model,
)
from opentinker.services.rollout.engines.vllm_adapters import AdapterVersions, WeightShapes
from opentinker.services.rollout.engines.vllm_engine import (
    PROBE_OPTIONS,
    add_lora,
    sampling_options,
    shutdown_llm,
    vllm_options,
)
from opentinker.services.rollout.engines.vllm_outputs import (
    completions_from_outputs,
    prompt_logprobs_from_output,
)
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.services.rollout.types import Completion
from opentinker.spec import LoraConfig, ModelSpec

log = structlog.get_logger("opentinker.rollout.vllm_multi_lora")


@dataclass(frozen=True)
class LoraRef:
    """One adapter version as vLLM serves it. lora_id: unique in the engine and never reused;
    name: unique too (vLLM compares LoRARequests by name); path: its PEFT folder."""

    name: str
    lora_id: int
    path: Path


@dataclass
class _Adapter:
    spec: ModelSpec
    shapes: WeightShapes
    versions: AdapterVersions
    served: LoraRef | None = None
    written: int = 0  # folders written so far (names the next one)


class AdapterTable:
    """Which job's adapter is served under which vLLM id, with its PEFT folders (no vLLM).

    A change is two steps so that vLLM can refuse it without leaving the table wrong:
    ``prepare`` writes the new version's folder and names it, the engine loads it, and
    ``commit`` makes it the one served, returning the previous (for vLLM to remove; its
    folder is deleted here). Not thread-safe: the engine holds its lock around every use.
    """

    def __init__(
        self,
        root: Path,
        *,
        base_model: str,
        capacity: int,
        max_lora_rank: int,
        shapes_of: Callable[[ModelSpec], WeightShapes] = WeightShapes.of,
    ) -> None:
        self.root = Path(root)
        self.base_model = base_model
        self.capacity = capacity
        self.max_lora_rank = max_lora_rank
        self._shapes_of = shapes_of
        self._adapters: dict[str, _Adapter] = {}
        self._ids = itertools.count(1)

    @property
    def adapters(self) -> list[str]:
        return list(self._adapters)

    def add(self, adapter: str, spec: ModelSpec) -> LoraRef:
        """Hold a fresh adapter for ``spec`` (its init_adapter, else zeros: the base model's
        outputs) and write its first folder; ValueError naming what does not fit."""
        check_shared_spec(spec, self.base_model)
        if spec.lora.rank > self.max_lora_rank:
            raise ValueError(
                f"LoRA rank {spec.lora.rank} is above this shared vLLM engine's max_lora_rank "
                f"{self.max_lora_rank}; give the job a private rollout or start the engine with "
                f"a larger --max-lora-rank"
            )
        if adapter in self._adapters:
            raise ValueError(f"adapter {adapter!r} is already loaded on this engine")
        if len(self._adapters) >= self.capacity:
            raise ValueError(
                f"this vLLM engine was started for {self.capacity} adapters (max_loras), all in use"
            )
        shapes = self._shapes_of(spec)
        entry = _Adapter(spec, shapes, AdapterVersions(spec, shapes, self.root / adapter))
        try:
            ref = self._write(adapter, entry)
        except BaseException:
            shutil.rmtree(entry.versions.root, ignore_errors=True)
            raise
        self._adapters[adapter] = entry
        return ref

    def prepare(self, adapter: str, tensors: Mapping[str, torch.Tensor]) -> LoraRef:
        """Take (part of) a weight update in the trainer's names and write it as a new
        version; WeightUpdateError before anything changes when a tensor is not this job's."""
        entry = self._entry(adapter)
        entry.shapes.check(tensors)
        entry.versions.update(tensors)
        return self._write(adapter, entry)

    def commit(self, adapter: str, ref: LoraRef) -> LoraRef | None:
        """``ref`` (loaded by vLLM) is now served; the previous one, if any, is returned and
        its folder deleted (vLLM keeps its own copy until it is removed)."""
        entry = self._entry(adapter)
        previous, entry.served = entry.served, ref
        if previous is not None:
            shutil.rmtree(previous.path, ignore_errors=True)
        return previous

    def discard(self, ref: LoraRef) -> None:
        """vLLM refused a prepared version: delete its folder (the served one stays)."""
        shutil.rmtree(ref.path, ignore_errors=True)

    def remove(self, adapter: str) -> LoraRef | None:
        """Forget the adapter and delete its folders; its served version (for vLLM to remove),
        or None for an adapter not held (a second remove is harmless)."""
        entry = self._adapters.pop(adapter, None)
        if entry is None:
            return None
        shutil.rmtree(entry.versions.root, ignore_errors=True)
        return entry.served

    def served(self, adapter: str) -> LoraRef:
        """The version a row of ``adapter`` runs on; ValueError for an adapter not loaded
        (never the bare base model in its place)."""
        ref = self._entry(adapter).served
        if ref is None:
            raise ValueError(f"adapter {adapter!r} has no version loaded yet")
        return ref

    def _entry(self, adapter: str) -> _Adapter:
        entry = self._adapters.get(adapter)
        if entry is None:
            raise ValueError(f"adapter {adapter!r} is not loaded on this shared engine")
        return entry

    def _write(self, adapter: str, entry: _Adapter) -> LoraRef:
        lora_id = next(self._ids)
        path = entry.versions.write(entry.written, suffix=f"-{lora_id}")
        ref = LoraRef(f"{adapter}-v{entry.written}-{lora_id}", lora_id, path)
        entry.written += 1
        return ref


@dataclass(frozen=True)
class RowRequest:
    """One row as one vLLM request: ``vllm.LLM.generate``'s prompt, ``SamplingParams``'
    keyword arguments, and the adapter version it runs on."""

    prompt: dict[str, list[int]]
    sampling: dict[str, Any]
    lora: LoraRef


def row_requests(
    rows: Sequence[LoraRow], table: AdapterTable, eos_token_id: int
) -> list[RowRequest]:
    """One request per row, each with its row's adapter (served version), sampling and seed.
    Every row's adapter is checked first: a row naming an unknown adapter fails the call
    before vLLM sees any of it."""
    refs = [table.served(row.adapter) for row in rows]
    out = []
    for row, ref in zip(rows, refs, strict=True):
        if len(row.prompt) == 0:
            raise ValueError("cannot generate from an empty prompt")
        options = sampling_options(row.sampling, row.seed, greedy=row.greedy, eos=eos_token_id)
        out.append(RowRequest({"prompt_token_ids": [int(t) for t in row.prompt]}, options, ref))
    return out


def multi_lora_options(
    base_model: str,
    settings: RolloutSettings,
    device: str,
    *,
    capacity: int,
    max_lora_rank: int,
) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for a shared engine of ``capacity`` adapters of rank at
    most ``max_lora_rank`` (pure; vllm_engine.py's options plus the LoRA slots)."""
    if capacity < 1:
        raise ValueError(f"a shared engine needs a capacity of at least 1, got {capacity}")
    spec = ModelSpec(base_model=base_model, finetune="lora", lora=LoraConfig(rank=max_lora_rank))
    options = vllm_options(spec, settings, device)  # max_lora_rank: vLLM's slot for the rank
    options["max_loras"] = capacity  # every job's adapter in one batch
    options["max_cpu_loras"] = capacity + 1  # + the version being switched to
    return options


class VllmMixedLoraEngine:
    """A ``vllm.LLM`` serving many jobs' LoRA adapters (see the module docstring).

    Thread-safe: one lock orders engine calls and adapter changes (``vllm.LLM`` is not
    re-entrant), so an update never lands in the middle of a call that reads its adapter.
    """

    name = "vllm-multi-lora"

    def __init__(self, llm: Any, tokenizer: PreTrainedTokenizerBase, table: AdapterTable) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token; the rollout cannot tell turns apart")
        self.llm = llm
        self.tokenizer = tokenizer
        self.eos_token_id: int = tokenizer.eos_token_id
        self.table = table
        self.base_model = table.base_model
        self.max_model_len: int = llm.llm_engine.model_config.max_model_len  # vLLM's, as set
        self._requests: dict[int, Any] = {}  # lora id -> the LoRARequest vLLM was given
        self._lock = threading.RLock()

    @classmethod
    def load(
        cls,
        base_model: str,
        settings: RolloutSettings,
        *,
        capacity: int,
        max_lora_rank: int,
        device: str = "cuda:0",
    ) -> VllmMixedLoraEngine:
        options = multi_lora_options(
            base_model, settings, device, capacity=capacity, max_lora_rank=max_lora_rank
        )
        check_text_model(base_model)
        if settings.tensor_parallel_size == 1 and settings.vllm_in_process:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as VllmEngine runs
        import vllm  # the `vllm` extra; only here

        root = Path(tempfile.mkdtemp(prefix="opentinker-shared-lora-"))
        table = AdapterTable(
            root, base_model=base_model, capacity=capacity, max_lora_rank=max_lora_rank
        )
        log.info(
            "vllm_multi_lora_starting",
            version=vllm.__version__,
            **{k: v for k, v in options.items() if k != "worker_extension_cls"},
        )
        llm = vllm.LLM(**options)
        return cls(llm, AutoTokenizer.from_pretrained(base_model), table)

    @property
    def adapters(self) -> list[str]:
        return self.table.adapters

    def add_adapter(self, adapter: str, spec: ModelSpec) -> None:
        with self._lock:
            ref = self.table.add(adapter, spec)
            try:
                self._load(ref)
            except BaseException:
                self.table.remove(adapter)
                raise
            self.table.commit(adapter, ref)

    def remove_adapter(self, adapter: str) -> None:
        with self._lock:
            served = self.table.remove(adapter)
            if served is not None:
                self._unload(served)

    def apply_adapter_weights(self, adapter: str, tensors: Mapping[str, torch.Tensor]) -> None:
        if not tensors:
            return  # the end of an update whose parts were each served as they came
        with self._lock:
            ref = self.table.prepare(adapter, tensors)
            try:
                self._load(ref)
            except BaseException:
                self.table.discard(ref)
                raise
            previous = self.table.commit(adapter, ref)
            if previous is not None:
                self._unload(previous)

    def generate_rows(self, rows: Sequence[LoraRow]) -> list[Completion]:
        if not rows:
            return []
        import vllm

        with self._lock:
            requests = row_requests(rows, self.table, self.eos_token_id)
            outputs = self.llm.generate(
                [r.prompt for r in requests],
                [vllm.SamplingParams(**r.sampling) for r in requests],
                use_tqdm=False,
                lora_request=[self._requests[r.lora.lora_id] for r in requests],
            )
        return completions_from_outputs(outputs, eos_token_id=self.eos_token_id)

    def adapter_logprobs_of(self, adapter: str, token_ids: Sequence[int]) -> list[float]:
        if len(token_ids) < 2:
            return []
        import vllm

        ids = [int(t) for t in token_ids]
        with self._lock:
            ref = self.table.served(adapter)
            outputs = self.llm.generate(
                [{"prompt_token_ids": ids}],
                vllm.SamplingParams(**PROBE_OPTIONS),
                use_tqdm=False,
                lora_request=self._requests[ref.lora_id],
            )
        return prompt_logprobs_from_output(outputs[0], ids)

    def close(self) -> None:
        """Free the GPU memory and the folders (tests start several engines)."""
        shutil.rmtree(self.table.root, ignore_errors=True)
        shutdown_llm(self)

    def _load(self, ref: LoraRef) -> None:
        # Loaded now: an adapter vLLM refuses fails here (WeightUpdateError, a ValueError).
        self._requests[ref.lora_id] = add_lora(self.llm, ref.name, ref.lora_id, ref.path)

    def _unload(self, ref: LoraRef) -> None:
        self._requests.pop(ref.lora_id, None)
        self.llm.llm_engine.remove_lora(ref.lora_id)
