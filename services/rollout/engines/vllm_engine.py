"""The vLLM generation engine: the ``GenerationEngine`` Protocol on one or more CUDA GPUs.

vLLM is an optional extra (``pip install 'opentinker[vllm]'``) and is imported here only.
What can be checked without a GPU lives beside it: turning vLLM's outputs into Completions
(``vllm_outputs.py``), the LoRA folders and update checks (``vllm_adapters.py``), the
engine choice (``engine_choice.py``).

- Sampling: one request per prompt, drawn from the engine's one generator (seeded 0 at
  start): vLLM draws the rows that carry their own seed one at a time, a kernel launch per row
  and token (its sampler's own TODO says so), which may be what left the engine at 0.75x of
  ``LLM.generate`` on an H100 (README). ``OPENTINKER_ROLLOUT_VLLM_SEED_PER_REQUEST=true``
  gives each its own seed (``derive_seed(seed, "vllm", i)``, so a call is deterministic for a
  seed as far as vLLM's kernels are, whatever ran before). ``logprobs=0`` and
  ``logprobs_mode="processed_logprobs"``: the sampled token's logprob under the distribution
  it was drawn from, i.e. ``log_softmax(logits / temperature)`` as the trainer recomputes it
  (with top_p < 1 vLLM renormalises over the nucleus; the transformers engine does not).
  It stops at eos only (``stop_token_ids=[eos]``; the session cuts at other stop tokens).
- LoRA: the adapter is written as a PEFT folder and served through a new ``LoRARequest`` (a
  new id each time) as each part of an update arrives (one part, for LoRA, as a rule); the
  previous one is removed from vLLM and its folder deleted. No restart.
- Full weights: copied in place by the model's own ``load_weights`` on every worker
  (``collective_rpc``, ``vllm_worker.py``), then the prefix cache is reset (its KV entries
  were computed with the old weights). Nothing is re-read from disk.
- ``logprobs_of``: ``prompt_logprobs=0`` on a one-token request, temperature 1, under the
  current adapter.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import structlog
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from opentinker.errors import ConfigError
from opentinker.services.modeling.cuda_ipc import meta_tensors
from opentinker.services.modeling.placement import dtype_for_device
from opentinker.services.modeling.template_choice import use_chat_template
from opentinker.services.rollout.agent.seeds import derive_seed
from opentinker.services.rollout.engines.engine import WeightUpdateError
from opentinker.services.rollout.engines.vllm_adapters import (
    AdapterVersions,
    WeightShapes,
    max_lora_rank_for,
)
from opentinker.services.rollout.engines.vllm_outputs import (
    completions_from_outputs,
    prompt_logprobs_from_output,
)
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.services.rollout.types import Completion
from opentinker.spec import ModelSpec, SamplingParams

log = structlog.get_logger("opentinker.rollout.vllm")

WORKER_EXTENSION = "opentinker.services.rollout.engines.vllm_worker.WeightUpdateExtension"


def vllm_options(spec: ModelSpec, settings: RolloutSettings, device: str) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for ``spec`` on ``device`` (pure; tested on CPU)."""
    if not device.startswith("cuda"):
        raise ConfigError(
            f"the vLLM engine runs on CUDA devices; the rollout's device is {device!r} "
            f"(set OPENTINKER_ROLLOUT_ENGINE=transformers for CPU)",
            reason="VLLM_NEEDS_CUDA",
        )
    if device not in ("cuda", "cuda:0"):
        raise ConfigError(
            f"the vLLM engine uses the GPUs CUDA_VISIBLE_DEVICES shows, from the first; "
            f"device {device!r} cannot be picked (the worker sets CUDA_VISIBLE_DEVICES to the "
            f"leased GPUs; leave OPENTINKER_ROLLOUT_DEVICE empty or 'cuda')",
            reason="VLLM_DEVICE",
        )
    options: dict[str, Any] = {
        "model": spec.base_model,
        "dtype": str(dtype_for_device(device)).removeprefix("torch."),  # placement.py's rule
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "enforce_eager": settings.vllm_enforce_eager,
        "seed": 0,
        "logprobs_mode": "processed_logprobs",
        # The checkpoint's generation_config.json (top_k, repetition_penalty, ...) would change
        # the distribution without the logprobs knowing; the transformers engine ignores it too.
        "generation_config": "vllm",
        "worker_extension_cls": WORKER_EXTENSION,
        "enable_prefix_caching": True,
    }
    if settings.vllm_max_model_len:
        options["max_model_len"] = settings.vllm_max_model_len
    if spec.finetune == "lora":
        options |= {
            "enable_lora": True,
            "max_lora_rank": max_lora_rank_for(spec.lora.rank),
            "max_loras": 2,  # the version served and the one being switched to
            "max_cpu_loras": 2,
        }
    return options


# ``vllm.SamplingParams`` of the probe: log p of each prompt token given the ones before it, at
# temperature 1 (one token is generated and thrown away).
PROBE_OPTIONS: dict[str, Any] = {
    "max_tokens": 1,
    "temperature": 1.0,
    "prompt_logprobs": 0,
    "detokenize": False,
}


def sampling_options(
    sampling: SamplingParams, seed: int | None, *, greedy: bool, eos: int
) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments of one request (pure; tested on CPU); seed
    None = drawn from the engine's generator."""
    options = {
        "n": 1,
        "temperature": 0.0 if greedy else sampling.temperature,  # 0 = argmax in vLLM
        "top_p": 1.0 if greedy else sampling.top_p,
        "max_tokens": sampling.max_new_tokens,
        "logprobs": 0,  # the sampled token's logprob only
        "stop_token_ids": [eos],
        "detokenize": False,  # the agent loop decodes what it needs
    }
    return options if seed is None else options | {"seed": seed}


class VllmEngine:
    """A ``vllm.LLM`` behind the GenerationEngine Protocol (see the module docstring)."""

    name = "vllm"

    def __init__(
        self,
        llm: Any,
        tokenizer: PreTrainedTokenizerBase,
        shapes: WeightShapes,
        adapters: AdapterVersions | None,
        *,
        seed_per_request: bool = False,
    ) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token; the rollout cannot tell turns apart")
        self.llm = llm
        self.tokenizer = tokenizer
        self.eos_token_id: int = tokenizer.eos_token_id
        self.shapes = shapes
        self.adapters = adapters
        self.policy_version = 0
        # vLLM's own: OPENTINKER_ROLLOUT_VLLM_MAX_MODEL_LEN, or what it derived from the config.
        self.max_model_len: int = llm.llm_engine.model_config.max_model_len
        self.seed_per_request = seed_per_request
        self.image_processor: object | None = None  # images: the transformers engine only
        self.lora_request: Any = None  # None = the base model
        # A new id per adapter loaded: vLLM caches adapters by id, so a re-sent version must
        # not reuse the id of the one served (it would keep serving the old tensors).
        self._lora_ids = itertools.count(1)
        if adapters is not None and adapters.changed:  # an init_adapter is version 0
            self._serve_adapter(0)
        elif adapters is not None:
            self._check_adapter_loads()

    @classmethod
    def load(
        cls, spec: ModelSpec, settings: RolloutSettings, *, device: str = "cuda:0"
    ) -> VllmEngine:
        """Start vLLM on ``spec.base_model`` (bf16, placement.py's rule for CUDA)."""
        options = vllm_options(spec, settings, device)
        if settings.tensor_parallel_size == 1 and settings.vllm_in_process:
            # One process: full-weight updates reach the worker by reference, not serialised.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        import vllm  # the `vllm` extra; only here

        tokenizer = AutoTokenizer.from_pretrained(spec.base_model)
        use_chat_template(tokenizer, spec.chat_template)  # the job's choice, if any
        shapes = WeightShapes.of(spec)
        adapters = None
        if spec.finetune == "lora":
            root = Path(tempfile.mkdtemp(prefix="opentinker-lora-"))
            atexit.register(shutil.rmtree, root, True)  # the folders die with the process
            adapters = AdapterVersions(spec, shapes, root)
        log.info("vllm_starting", version=vllm.__version__, **_loggable(options))
        llm = vllm.LLM(**options)
        try:
            return cls(
                llm, tokenizer, shapes, adapters, seed_per_request=settings.vllm_seed_per_request
            )
        except BaseException:  # e.g. an adapter vLLM refuses: free the GPU before the error
            shutdown_llm(SimpleNamespace(llm=llm))
            if adapters is not None:
                shutil.rmtree(adapters.root, ignore_errors=True)
            raise

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        seed: int,
        *,
        greedy: bool = False,
        images: Sequence[Sequence[object]] | None = None,
    ) -> list[Completion]:
        if images is not None and any(images):
            raise ValueError(
                "the vLLM engine does not take images; run vision environments with "
                "OPENTINKER_ROLLOUT_ENGINE=transformers"
            )
        if any(len(p) == 0 for p in prompts):
            raise ValueError("cannot generate from an empty prompt")
        if not prompts:
            return []
        params = [
            self._sampling(
                sampling,
                derive_seed(seed, "vllm", i) if self.seed_per_request else None,
                greedy=greedy,
            )
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts],
            params,
            use_tqdm=False,
            lora_request=self.lora_request,
        )
        return completions_from_outputs(outputs, eos_token_id=self.eos_token_id)

    def _sampling(self, sampling: SamplingParams, seed: int | None, *, greedy: bool) -> Any:
        import vllm

        return vllm.SamplingParams(
            **sampling_options(sampling, seed, greedy=greedy, eos=self.eos_token_id)
        )

    def apply_weights(self, tensors: Mapping[str, torch.Tensor], policy_version: int) -> None:
        """Part of an update (``policy_version`` = the one served) or its end (a new one)."""
        self.shapes.check(tensors)  # before anything changes
        if self.adapters is not None:
            # Every part is served at once (a new adapter id), as the transformers engine copies
            # each part in place: a re-sent version is never mistaken for a partial one. LoRA
            # updates are small and come in one chunk or a few. An end with no tensors (CUDA
            # IPC and shared-memory updates end so: their parts came before) changes only the
            # version: what is served already holds every part, so nothing is loaded again.
            self.adapters.update(tensors)
            if tensors:
                self._serve_adapter(policy_version)
        elif tensors:
            pairs = list(tensors.items())
            self.llm.collective_rpc("opentinker_load_weights", args=(pairs,))
            self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self.policy_version = policy_version

    def apply_cuda_ipc(self, described: Sequence[Any]) -> None:
        """Full weights from the trainer's CUDA IPC handles (``CudaIpcTensor`` messages): each
        worker opens them on its own GPU and loads them in place (``vllm_worker.py``), as
        ``apply_weights`` does with tensors; the version stays until the update ends."""
        if self.adapters is not None:
            raise WeightUpdateError(
                "a LoRA engine takes adapter tensors by value; send them inline or in shared memory"
            )
        # Names and shapes first, as apply_weights does: vLLM's load_weights would fail deep in
        # its worker (an assert in a weight loader, a KeyError), or copy part of the update.
        try:
            carried = meta_tensors(described)
        except ValueError as err:  # an unknown dtype
            raise WeightUpdateError(str(err)) from err
        self.shapes.check(carried)
        blobs = [d.SerializeToString() for d in described]  # plain bytes cross to the workers
        self.llm.collective_rpc("opentinker_load_ipc_weights", args=(blobs,))
        self.llm.reset_prefix_cache()

    def _serve_adapter(self, version: int) -> None:
        assert self.adapters is not None
        lora_id = next(self._lora_ids)
        folder = self.adapters.write(version, suffix=f"-{lora_id}")
        request = add_lora(self.llm, f"policy-v{version}-{lora_id}", lora_id, folder)
        previous, self.lora_request = self.lora_request, request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)  # vLLM holds it in memory

    def _check_adapter_loads(self) -> None:
        """Version 0 of a fresh adapter is the base model, served without one; its folder is
        loaded once and dropped here all the same, so that an adapter vLLM cannot serve (a
        target module the model's vLLM class takes no LoRA on, e.g. Qwen2's embed_tokens or
        lm_head) fails the job at start, not at its first weight sync."""
        assert self.adapters is not None
        lora_id = next(self._lora_ids)
        folder = self.adapters.write(0, suffix=f"-check-{lora_id}")
        try:
            add_lora(self.llm, f"policy-check-{lora_id}", lora_id, folder)
            self.llm.llm_engine.remove_lora(lora_id)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def logprobs_of(self, token_ids: Sequence[int]) -> list[float]:
        if len(token_ids) < 2:
            return []
        import vllm

        ids = list(token_ids)
        params = vllm.SamplingParams(**PROBE_OPTIONS)
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids}], params, use_tqdm=False, lora_request=self.lora_request
        )
        return prompt_logprobs_from_output(outputs[0], ids)

    def close(self) -> None:
        """Free the GPU memory and the adapter folders (tests start several engines)."""
        if self.adapters is not None:
            shutil.rmtree(self.adapters.root, ignore_errors=True)
        shutdown_llm(self)


def add_lora(llm: Any, name: str, lora_id: int, folder: Path) -> Any:
    """Load the PEFT adapter in ``folder`` into ``llm`` (a ``vllm.LLM``) now, under ``name``
    and ``lora_id``; its ``LoRARequest``. WeightUpdateError with vLLM's reason when vLLM refuses
    it (rank above max_lora_rank, a target module it takes no LoRA on); the folder is deleted."""
    from vllm.lora.request import LoRARequest

    request = LoRARequest(name, lora_id, str(folder))
    try:
        llm.llm_engine.add_lora(request)
    # vLLM raises ValueError in process; its engine-process client re-raises any worker error
    # as a bare Exception carrying the message, so nothing narrower catches both.
    except Exception as err:  # noqa: BLE001
        shutil.rmtree(folder, ignore_errors=True)
        raise WeightUpdateError(f"vLLM refused the LoRA adapter {name}: {err}") from err
    return request


def shutdown_llm(owner: Any) -> None:
    """Stop ``owner.llm`` (a ``vllm.LLM``) and free its GPU memory; ``owner.llm`` becomes
    None first, so that the collection below finds the last reference gone."""
    llm, owner.llm = owner.llm, None
    engine = getattr(llm, "llm_engine", None)
    shutdown = getattr(engine, "shutdown", None) or getattr(
        getattr(engine, "engine_core", None), "shutdown", None
    )
    if callable(shutdown):
        shutdown()
    del llm, engine, shutdown
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()  # vLLM's own teardown: process groups, caches
    gc.collect()


def _loggable(options: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k != "worker_extension_cls"}
