"""Many jobs' LoRA adapters on one base model, served in one batched engine call.

``MixedLoraEngine`` is the contract: each job's adapter is loaded under its own name, and a
call takes rows, each naming the adapter that continues it (one LoRA request per row: what a
vLLM engine does with a ``LoRARequest`` per prompt). ``SharedLoraEngine`` implements it with
transformers and peft's mixed-adapter batches (``adapter_names=`` in ``generate``/``forward``).

Every row samples with its own seed (its own ``torch.Generator``, Gumbel-max over the
temperature/top-p distribution), so a row's tokens depend only on its prompt, its adapter and
its seed, never on which other jobs' rows share the call. Its logprobs can differ from those of
the same row run alone in the last float bits (a wider batch pads it more on the left); the
tokens then differ only at an exact near-tie (tests/rollout/test_multi_lora_engine.py).

``AdapterEngine`` is one job's view: a ``GenerationEngine`` (engine.py) whose calls go through
the shared ``MixedBatcher`` (batcher.py) with the job's adapter, whose weight updates touch only
that adapter, and whose probe scores with it.
"""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import peft
import torch
import transformers
from transformers import AutoTokenizer, LogitsProcessor, PreTrainedTokenizerBase

from opentinker.services.modeling.adapters import load_init_adapter, peft_lora_config
from opentinker.services.modeling.attention import has_full_attention_only
from opentinker.services.modeling.context_length import context_length
from opentinker.services.modeling.placement import dtype_for_device
from opentinker.services.modeling.vision_inputs import load_image_processor
from opentinker.services.rollout.engines.engine import copy_checked, cut_at_eos, eos_and_pad_ids
from opentinker.services.rollout.engines.prefix_cache import PrefixCache
from opentinker.services.rollout.engines.shared_prefill import prompt_inputs
from opentinker.services.rollout.engines.top_logprobs import top_k_rows
from opentinker.services.rollout.settings import DEFAULT_MAX_BATCH_SIZE
from opentinker.services.rollout.types import Completion
from opentinker.spec import ModelSpec, SamplingParams

# The adapter name the trainer's tensors carry (peft's default): mapped to the job's own here.
TRAINER_ADAPTER = "default"


@dataclass(frozen=True)
class LoraRow:
    """One row of a mixed-adapter call: continue ``prompt`` with ``adapter``'s weights.

    seed: the row's own sampling seed; greedy: argmax decoding (logprobs at temperature 1).
    """

    prompt: Sequence[int]
    adapter: str
    sampling: SamplingParams
    seed: int
    greedy: bool = False


class MixedLoraEngine(Protocol):
    """A base model serving many named LoRA adapters in one batched call."""

    name: str
    base_model: str
    tokenizer: PreTrainedTokenizerBase
    max_model_len: int  # the longest sequence (tokens: prompt and completion) it takes

    def add_adapter(self, adapter: str, spec: ModelSpec) -> None:
        """Load a fresh adapter (``spec.lora``; ``spec.init_adapter``'s weights if given)."""
        ...

    def remove_adapter(self, adapter: str) -> None: ...

    def generate_rows(self, rows: Sequence[LoraRow]) -> list[Completion]:
        """One completion per row, each with its row's adapter, sampling and seed."""
        ...

    def apply_adapter_weights(self, adapter: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy the trainer's adapter tensors (named as the trainer names them) into
        ``adapter``; any other tensor (a base weight, another adapter's) is refused."""
        ...

    def adapter_logprobs_of(self, adapter: str, token_ids: Sequence[int]) -> list[float]:
        """log p(ids[i+1] | ids[:i+1]) at temperature 1 under ``adapter``."""
        ...


def check_text_model(base_model: str) -> None:
    """ValueError for a vision-language base model: a shared engine serves text models."""
    if load_image_processor(base_model) is not None:
        raise ValueError(
            f"{base_model} is a vision-language model; a shared engine serves text models "
            f"(its jobs keep a private rollout)"
        )


def check_shared_spec(spec: ModelSpec, base_model: str) -> None:
    """ValueError unless ``spec`` is a LoRA job of ``base_model`` (what a shared engine serves)."""
    if spec.finetune != "lora":
        raise ValueError(f"a shared engine serves LoRA jobs only; this one is {spec.finetune}")
    if spec.base_model != base_model:
        raise ValueError(
            f"this shared engine serves base model {base_model!r}, "
            f"the job asks for {spec.base_model!r}"
        )


def adapter_name_for(job_id: str) -> str:
    """A job's adapter name: peft module keys may not contain dots."""
    return "job_" + re.sub(r"[^A-Za-z0-9_]", "_", job_id)


class SharedLoraEngine:
    """transformers + peft: one base model, any number of named LoRA adapters.

    Thread-safe: one lock orders engine calls, weight copies and adapter changes, so an
    update of one adapter never lands in the middle of a call that reads it.
    """

    name = "transformers-multi-lora"

    def __init__(
        self,
        model: transformers.PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        base_model: str,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    ) -> None:
        self.base = model
        self.tokenizer = tokenizer
        self.base_model = base_model
        self.max_model_len = context_length(model.config)
        self.max_batch_size = max_batch_size
        self.eos_token_id, self.pad_token_id = eos_and_pad_ids(tokenizer)
        # A checkpoint's own sampling defaults (repetition_penalty, ...) would change what is
        # sampled without the logprobs knowing (as in TransformersEngine).
        model.generation_config = transformers.GenerationConfig(
            eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id
        )
        self.device = next(model.parameters()).device
        self.model: peft.PeftModel | None = None  # wrapped at the first adapter
        # adapter -> {the trainer's tensor name -> this engine's parameter}
        self._params: dict[str, dict[str, torch.nn.Parameter]] = {}
        self._lock = threading.RLock()
        # Multi-turn jobs' keys and values between turns (prefix_cache.py): one cache, its
        # entries tagged with their adapter, for the adapters that asked (``keep_prefixes``).
        self.prefixes: PrefixCache | None = None
        self._keeping: set[str] = set()

    @classmethod
    def load(
        cls, base_model: str, *, device: str = "cpu", max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    ) -> SharedLoraEngine:
        """``base_model`` (a local folder or hub id) on ``device`` with the trainer's dtype."""
        transformers.utils.logging.disable_progress_bar()
        check_text_model(base_model)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            base_model, dtype=dtype_for_device(device)
        )
        model = model.to(device)  # type: ignore[arg-type]  # transformers types .to() narrowly
        model.eval()
        tokenizer = AutoTokenizer.from_pretrained(base_model)
        return cls(model, tokenizer, base_model=base_model, max_batch_size=max_batch_size)

    @property
    def adapters(self) -> list[str]:
        return list(self._params)

    def add_adapter(self, adapter: str, spec: ModelSpec) -> None:
        check_shared_spec(spec, self.base_model)
        config = peft_lora_config(spec.lora)  # as the trainer wraps it
        with self._lock:
            if adapter in self._params:
                raise ValueError(f"adapter {adapter!r} is already loaded on this engine")
            if self.model is None:
                self.model = peft.get_peft_model(self.base, config, adapter_name=adapter)
            else:
                self.model.add_adapter(adapter, config)
            if self.model.active_adapter not in self.model.peft_config:  # all were removed
                self.model.set_adapter(adapter)
            self.model.eval()
            if spec.init_adapter is not None:
                load_init_adapter(self.model, spec, self.device, adapter_name=adapter)
            self._params[adapter] = _trainer_names(self.model, adapter)

    def keep_prefixes(self, adapter: str, capacity_bytes: int) -> None:
        """Keep ``adapter``'s finished rows' keys and values for the prompts that continue
        them (its job's episodes take several turns). The adapters share one cache, as large
        as the largest asked for; 0 stops it for ``adapter`` and forgets its entries."""
        with self._lock:
            self._require(adapter)
            if capacity_bytes <= 0 or not has_full_attention_only(self.base):
                self._forget_prefixes(adapter)
                return
            self._keeping.add(adapter)
            if self.prefixes is None:
                self.prefixes = PrefixCache(capacity_bytes, self.eos_token_id)
            self.prefixes.capacity_bytes = max(self.prefixes.capacity_bytes, capacity_bytes)

    def keeps_prefixes(self, adapter: str) -> bool:
        return adapter in self._keeping

    def _forget_prefixes(self, adapter: str) -> None:
        self._keeping.discard(adapter)
        if self.prefixes is not None:
            self.prefixes.drop(adapter)

    def remove_adapter(self, adapter: str) -> None:
        with self._lock:
            self._forget_prefixes(adapter)
            if self._params.pop(adapter, None) is None or self.model is None:
                return
            with warnings.catch_warnings():  # "adapter X was active ...": we pass names per row
                warnings.simplefilter("ignore", UserWarning)
                self.model.delete_adapter(adapter)

    @torch.no_grad()
    def generate_rows(self, rows: Sequence[LoraRow]) -> list[Completion]:
        with self._lock:
            for row in rows:
                self._require(row.adapter)
            out: list[Completion] = []
            for start in range(0, len(rows), self.max_batch_size):
                out.extend(self._generate_chunk(rows[start : start + self.max_batch_size]))
            return out

    def _generate_chunk(self, rows: Sequence[LoraRow]) -> list[Completion]:
        assert self.model is not None, "rows name loaded adapters"
        adapters = [r.adapter for r in rows]
        prompts = [r.prompt for r in rows]

        def forward_kwargs(distinct: list[int]) -> dict[str, list[str]]:
            return self._adapters_of([adapters[b] for b in distinct])

        continued = None
        if self.prefixes is not None and self._keeping.intersection(adapters):
            continued = self.prefixes.continued(
                self.model, prompts, adapters, self.pad_token_id, self.device, forward_kwargs
            )
        inputs = continued or prompt_inputs(
            self.model,
            prompts,
            self.pad_token_id,
            self.device,
            tags=adapters,  # a prompt is shared only under the same adapter
            forward_kwargs=forward_kwargs,
        )
        width = inputs["input_ids"].shape[1]
        sampler = RowSampler(rows, self.device)
        result = self.model.generate(
            **inputs,
            **self._adapters_of(adapters),
            do_sample=False,  # the choice is the sampler's argmax of logprob + Gumbel noise
            temperature=None,
            top_p=None,
            top_k=None,
            logits_processor=transformers.LogitsProcessorList([sampler]),
            max_new_tokens=max(r.sampling.max_new_tokens for r in rows),
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
        new_B_N = result.sequences[:, width:].cpu()
        logits_B_N_V = torch.stack(result.logits, dim=1).float().cpu()
        temperature_B = sampler.temperature_B.cpu()
        logprobs_B_N_V = torch.log_softmax(logits_B_N_V / temperature_B[:, None, None], dim=-1)
        sampled_B_N = logprobs_B_N_V.gather(-1, new_B_N.unsqueeze(-1)).squeeze(-1)
        completions = [  # each row ends at its own token budget
            cut_at_eos(
                new_B_N[b, : row.sampling.max_new_tokens].tolist(),
                sampled_B_N[b].tolist(),
                self.eos_token_id,
            )
            for b, row in enumerate(rows)
        ]
        if self.prefixes is not None:
            kept = [(b, row.prompt, completions[b], row.adapter) for b, row in enumerate(rows)]
            kept = [entry for entry in kept if entry[3] in self._keeping]
            self.prefixes.keep_rows(result.past_key_values, width, kept)
        return completions

    @torch.no_grad()
    def apply_adapter_weights(self, adapter: str, tensors: Mapping[str, torch.Tensor]) -> None:
        with self._lock:
            copy_checked(
                self._require(adapter),
                tensors,
                unknown="which is not a tensor of this job's LoRA adapter (a shared engine takes "
                "only the job's own adapter tensors; is the LoRA config the same as the "
                "trainer's?)",
            )
            if self.prefixes is not None:  # keys and values of the adapter's old weights
                self.prefixes.drop(adapter)

    @torch.no_grad()
    def adapter_logprobs_of(self, adapter: str, token_ids: Sequence[int]) -> list[float]:
        if len(token_ids) < 2:
            return []
        ids_1_T, logprobs_T_V = self._next_logprobs(adapter, token_ids)
        return logprobs_T_V.gather(-1, ids_1_T[0, 1:].unsqueeze(-1)).squeeze(-1).cpu().tolist()

    @torch.no_grad()
    def adapter_top_logprobs_of(
        self, adapter: str, token_ids: Sequence[int], k: int
    ) -> tuple[list[int], list[float]]:
        """The k likeliest next tokens at each position under ``adapter`` (top_k_rows)."""
        return top_k_rows(self._next_logprobs(adapter, token_ids)[1], k)

    def _next_logprobs(
        self, adapter: str, token_ids: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids as 1 x T, and every next token's logprob at each position but the last
        under ``adapter``: (T - 1) x V."""
        with self._lock:
            self._require(adapter)
            assert self.model is not None
            ids_1_T = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
            logits_T_V = self.model(input_ids=ids_1_T, **self._adapters_of([adapter])).logits
            logits_T_V = logits_T_V[0, :-1]
        return ids_1_T, torch.log_softmax(logits_T_V.float(), dim=-1)

    def _adapters_of(self, adapters: list[str]) -> dict[str, list[str]]:
        """The call's adapter arguments: one adapter per row (peft's mixed batch), or, when
        every row has the same one, that adapter made active and the plain LoRA forward
        (peft's mixed batch adds a gather and a scatter to every LoRA layer at every step)."""
        assert self.model is not None
        if len(set(adapters)) > 1:
            return {"adapter_names": adapters}
        if self.model.active_adapter != adapters[0]:
            self.model.set_adapter(adapters[0])
        return {}

    def _require(self, adapter: str) -> dict[str, torch.nn.Parameter]:
        # peft silently runs the bare base for a name it does not know: never let it.
        params = self._params.get(adapter)
        if params is None:
            raise ValueError(f"adapter {adapter!r} is not loaded on this shared engine")
        return params


def _trainer_names(model: torch.nn.Module, adapter: str) -> dict[str, torch.nn.Parameter]:
    """The adapter's parameters under the names the trainer gives them (its adapter is
    ``default``): ``...q_proj.lora_A.<adapter>.weight`` -> ``...q_proj.lora_A.default.weight``."""
    pattern = re.compile(rf"\.(lora_\w+)\.{re.escape(adapter)}(?=\.|$)")
    out = {}
    for name, param in model.named_parameters():
        if pattern.search(name):
            out[pattern.sub(rf".\1.{TRAINER_ADAPTER}", name)] = param
    return out


class RowSampler(LogitsProcessor):
    """Sampling per row inside a greedy ``generate``: each row's scores become its
    temperature/top-p log-probabilities plus Gumbel noise from the row's own generator, so the
    argmax is a sample of that row's distribution drawn with that row's seed. Greedy rows keep
    their raw scores."""

    def __init__(self, rows: Sequence[LoraRow], device: torch.device) -> None:
        self.temperature_B = torch.tensor(
            [1.0 if r.greedy else r.sampling.temperature for r in rows], device=device
        )
        self.top_p_B = torch.tensor([r.sampling.top_p for r in rows], device=device)
        self.greedy_B = torch.tensor([r.greedy for r in rows], device=device)
        self.generators = []
        for r in rows:
            generator = torch.Generator(device=device)
            generator.manual_seed(r.seed)
            self.generators.append(generator)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logp_B_V = torch.log_softmax(scores.float() / self.temperature_B[:, None], dim=-1)
        if bool((self.top_p_B < 1).any()):
            logp_B_V = _top_p(logp_B_V, self.top_p_B)
        vocab = scores.shape[-1]
        uniform_B_V = torch.stack(
            [torch.rand(vocab, generator=g, device=scores.device) for g in self.generators]
        )
        gumbel_B_V = -torch.log(-torch.log(uniform_B_V.clamp(1e-20, 1.0 - 1e-7)))
        sampled_B_V = logp_B_V + gumbel_B_V
        # a FloatTensor in all but name (the LogitsProcessor signature asks for that subclass)
        return torch.where(self.greedy_B[:, None], scores.float(), sampled_B_V)  # type: ignore[return-value]


def _top_p(logp_B_V: torch.Tensor, top_p_B: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose mass reaches its top_p."""
    sorted_B_V, order_B_V = logp_B_V.sort(dim=-1, descending=True)
    mass_before_B_V = sorted_B_V.exp().cumsum(dim=-1) - sorted_B_V.exp()
    drop_sorted_B_V = mass_before_B_V >= top_p_B[:, None]  # the top token is always kept
    drop_B_V = drop_sorted_B_V.scatter(-1, order_B_V, drop_sorted_B_V)
    return logp_B_V.masked_fill(drop_B_V, float("-inf"))
