"""Generation engines: sample completions with per-token logprobs, take weight updates.

``GenerationEngine`` is the small contract the agent loop and the service rely on;
``TransformersEngine`` implements it with Hugging Face transformers (CPU, or one CUDA GPU).
A vLLM engine implements the same Protocol in its own module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import peft
import torch
import transformers
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from opentinker.services.modeling.adapters import load_init_adapter, peft_lora_config
from opentinker.services.modeling.attention import has_full_attention_only
from opentinker.services.modeling.context_length import context_length
from opentinker.services.modeling.placement import dtype_for_device
from opentinker.services.modeling.preload import PreloadedModel
from opentinker.services.modeling.role_adapters import activate, add_role_adapters, each_role
from opentinker.services.modeling.template_choice import use_chat_template
from opentinker.services.modeling.vision_inputs import (
    ImageInput,
    load_image_processor,
    load_language_model,
)
from opentinker.services.rollout.agent.multimodal import generate_each_with_images
from opentinker.services.rollout.engines.prefix_cache import PrefixCache
from opentinker.services.rollout.engines.shared_prefill import prompt_inputs
from opentinker.services.rollout.settings import DEFAULT_MAX_BATCH_SIZE
from opentinker.services.rollout.types import Completion
from opentinker.spec import ModelSpec, SamplingParams

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class WeightUpdateError(ValueError):
    """A weight update does not fit the model (unknown tensor name, wrong shape)."""


class GenerationEngine(Protocol):
    """What the rollout needs from a generation engine."""

    name: str  # "transformers" or "vllm", reported in RolloutOpened
    policy_version: int  # version of the weights now served; 0 right after loading
    max_model_len: int  # the longest sequence (tokens: prompt and completion) it takes

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...  # read-only: a shared engine's own

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        seed: int,
        *,
        greedy: bool = False,
    ) -> list[Completion]:
        """Sample one completion per prompt; deterministic for a given seed and batch.
        greedy: argmax decoding; logprobs are then at temperature 1."""
        ...

    def apply_weights(self, tensors: Mapping[str, torch.Tensor], policy_version: int) -> None:
        """Copy named tensors into the served weights, then serve ``policy_version``. The
        tensors may be views of the trainer's shared-memory segment, rewritten once this
        returns: copy them, never keep a reference."""
        ...

    def logprobs_of(self, token_ids: Sequence[int]) -> list[float]:
        """log p(token_ids[i+1] | token_ids[:i+1]) at temperature 1; len(token_ids)-1 entries."""
        ...


class TransformersEngine:
    """A transformers causal LM sampling with its KV cache, batched with left padding.

    With ``finetune == "lora"`` the model is wrapped with peft exactly as the trainer wraps
    it, so the adapter tensors the trainer sends have the same names here.
    """

    name = "transformers"

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.policy_version = 0
        self.max_model_len = context_length(model.config)
        self.max_batch_size = max_batch_size
        self.eos_token_id, self.pad_token_id = eos_and_pad_ids(tokenizer)
        self.device = next(model.parameters()).device
        # A vision-language model's image processor (set by ``load``); None = text only.
        self.image_processor: object | None = None
        # Multi-agent self-play with one LoRA adapter per role (``use_role_adapters``).
        self.role_adapters: tuple[str, ...] = ()
        # Multi-turn episodes' keys and values between turns (``keep_prefixes``); None = off.
        self.prefixes: PrefixCache | None = None
        # A checkpoint's own sampling defaults (top_k, repetition_penalty, ...) would change the
        # distribution we sample from without the logprobs knowing; start from a clean config.
        self.model.generation_config = GenerationConfig(
            eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id
        )

    @classmethod
    def load(
        cls,
        spec: ModelSpec,
        *,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        device: str | None = None,
        adapter_dir: str | None = None,
        preloaded: PreloadedModel | None = None,
    ) -> TransformersEngine:
        """Load ``spec.base_model`` and wrap LoRA if asked.

        device: "cpu" (float32) or "cuda[:n]" (bfloat16); default: CUDA when there is one.
        adapter_dir: a saved PEFT adapter (a trained LoRA checkpoint) to apply to the base and
        merge into it; its tokenizer is used when it has one. Not combined with LoRA training.
        preloaded: ``spec.base_model`` read by a warm spare (float32, CPU); used as is.
        """
        transformers.utils.logging.disable_progress_bar()
        target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype_for_device(str(target))  # the trainer's rule: the two agree
        has_own_tokenizer = adapter_dir is not None and any(
            (Path(adapter_dir) / name).exists() for name in _TOKENIZER_FILES
        )
        if preloaded is not None and not has_own_tokenizer:
            tokenizer = preloaded.tokenizer
        else:
            tokenizer = AutoTokenizer.from_pretrained(
                adapter_dir if has_own_tokenizer else spec.base_model
            )
        use_chat_template(tokenizer, spec.chat_template)  # the job's choice, if any
        if preloaded is not None:  # float32 on CPU; bfloat16 on CUDA, as from_pretrained gives
            model = preloaded.model.to(dtype=dtype)  # type: ignore[call-arg]  # as .to() below
        else:
            model = load_language_model(spec.base_model, dtype=dtype)
        if adapter_dir is not None:
            if spec.finetune == "lora":
                raise ValueError("adapter_dir is for serving a trained adapter, not LoRA training")
            adapted = peft.PeftModel.from_pretrained(model, adapter_dir)
            model = adapted.merge_and_unload()  # type: ignore[assignment]  # a plain model again
        model = model.to(target)  # type: ignore[arg-type]  # transformers types .to() narrowly
        if spec.finetune == "lora":
            # As the trainer wraps it (same tensor names). PeftModel forwards every
            # PreTrainedModel method (generate, named_parameters, ...).
            model = peft.get_peft_model(model, peft_lora_config(spec.lora))  # type: ignore[assignment]
            load_init_adapter(model, spec, target)  # the trainer's starting adapter, as it loads it
        model.eval()
        engine = cls(model, tokenizer, max_batch_size=max_batch_size)
        engine.image_processor = load_image_processor(spec.base_model)
        return engine

    def use_role_adapters(self, roles: tuple[str, ...]) -> None:
        """Serve one LoRA adapter per role, as the trainer trains them (role_adapters.py)."""
        add_role_adapters(self.model, roles)
        self.role_adapters = tuple(roles)
        if self.prefixes is not None:
            self.prefixes.clear()

    def keep_prefixes(self, capacity_bytes: int) -> None:
        """Keep finished rows' keys and values for the prompts that continue them (multi-turn
        episodes; prefix_cache.py), up to ``capacity_bytes``. Text models whose every layer
        attends to the whole sequence only; 0 turns it off."""
        usable = self.image_processor is None and has_full_attention_only(self.model)
        keep = usable and capacity_bytes > 0
        self.prefixes = PrefixCache(capacity_bytes, self.eos_token_id) if keep else None

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        seed: int,
        *,
        greedy: bool = False,
        images: Sequence[Sequence[ImageInput]] | None = None,
        adapter: str | None = None,
    ) -> list[Completion]:
        """images: per prompt, the images its placeholder tokens stand for (vision models).
        adapter: the role whose adapter serves this call (one adapter per role); None = the
        model as it is."""
        if adapter is not None:
            if adapter not in self.role_adapters:
                raise ValueError(
                    f"no adapter for role {adapter!r}; this engine serves {self.role_adapters}"
                )
            activate(self.model, adapter, self.role_adapters)
        if images is not None and any(images):
            decoding = _decoding(sampling, greedy=greedy)
            return generate_each_with_images(self, prompts, images, sampling, seed, decoding)
        if greedy:  # argmax = temperature 1 with only the top token kept
            sampling = sampling.model_copy(update={"temperature": 1.0})
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out: list[Completion] = []
            for start in range(0, len(prompts), self.max_batch_size):
                out.extend(
                    self._generate_batch(
                        prompts[start : start + self.max_batch_size],
                        sampling,
                        greedy=greedy,
                        adapter=adapter,
                    )
                )
            return out

    def _generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        greedy: bool = False,
        adapter: str | None = None,
    ) -> list[Completion]:
        continued, tags = None, [adapter] * len(prompts)  # entries are kept per adapter
        if self.prefixes is not None:
            continued = self.prefixes.continued(
                self.model, prompts, tags, self.pad_token_id, self.device
            )
        inputs = continued or prompt_inputs(
            self.model,
            prompts,
            self.pad_token_id,
            self.device,
            share=self.image_processor is None,  # vision-language: 3-D rope positions
        )
        width = inputs["input_ids"].shape[1]
        result = self.model.generate(  # type: ignore[operator]  # peft wrapper hides the type
            **inputs,
            **_decoding(sampling, greedy=greedy),
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
        new_B_N = result.sequences[:, width:].cpu()
        # Raw logits of every generated position: N x (B, V) -> (B, N, V).
        logits_B_N_V = torch.stack(result.logits, dim=1).float().cpu()
        logprobs_B_N_V = torch.log_softmax(logits_B_N_V / sampling.temperature, dim=-1)
        sampled_B_N = logprobs_B_N_V.gather(-1, new_B_N.unsqueeze(-1)).squeeze(-1)
        completions = [
            cut_at_eos(new_B_N[row].tolist(), sampled_B_N[row].tolist(), self.eos_token_id)
            for row in range(len(prompts))
        ]
        if self.prefixes is not None:
            rows = zip(range(len(prompts)), prompts, completions, tags, strict=True)
            self.prefixes.keep_rows(result.past_key_values, width, rows)
        return completions

    @torch.no_grad()
    def apply_weights(self, tensors: Mapping[str, torch.Tensor], policy_version: int) -> None:
        copy_checked(
            dict(self.model.named_parameters()),
            tensors,
            unknown=f"which this model does not have ({type(self.model).__name__}; is the LoRA "
            f"config the same as the trainer's?)",
        )
        if self.prefixes is not None:  # keys and values of the old weights
            self.prefixes.clear()
        self.policy_version = policy_version

    @torch.no_grad()
    def logprobs_of(self, token_ids: Sequence[int]) -> list[float]:
        """With one adapter per role: every role's, in role order (the trainer's probe)."""
        if self.role_adapters:
            return each_role(self.model, self.role_adapters, lambda: self._logprobs_of(token_ids))
        return self._logprobs_of(token_ids)

    def _logprobs_of(self, token_ids: Sequence[int]) -> list[float]:
        if len(token_ids) < 2:
            return []
        ids_1_T = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        logits_T_V = self.model(input_ids=ids_1_T).logits[0, :-1].float()
        logprobs_T_V = torch.log_softmax(logits_T_V, dim=-1)
        return logprobs_T_V.gather(-1, ids_1_T[0, 1:].unsqueeze(-1)).squeeze(-1).cpu().tolist()


def eos_and_pad_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, int]:
    """The tokenizer's eos id and its pad id (eos when it has none); ValueError without eos."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; the rollout cannot tell turns apart")
    eos: int = tokenizer.eos_token_id
    return eos, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos


def cut_at_eos(ids: list[int], logprobs: list[float], eos_token_id: int) -> Completion:
    """A generated row up to and including its first eos; what follows is padding."""
    length = ids.index(eos_token_id) + 1 if eos_token_id in ids else len(ids)
    return Completion(token_ids=ids[:length], logprobs=logprobs[:length])


@torch.no_grad()
def copy_checked(
    params: Mapping[str, torch.nn.Parameter],
    tensors: Mapping[str, torch.Tensor],
    *,
    unknown: str,
) -> None:
    """Copy named tensors into ``params``; all are checked first, so a bad update (a name not
    in ``params``: WeightUpdateError "…names tensor X, <unknown>"; a wrong shape) changes
    nothing."""
    for name, tensor in tensors.items():
        if name not in params:
            raise WeightUpdateError(f"weight update names tensor {name!r}, {unknown}")
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise WeightUpdateError(
                f"weight update tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model's has {tuple(params[name].shape)}"
            )
    for name, tensor in tensors.items():
        params[name].copy_(tensor.to(device=params[name].device, dtype=params[name].dtype))


def _decoding(sampling: SamplingParams, *, greedy: bool) -> dict:
    """generate() options: argmax, or sampling shaped by temperature and top_p only."""
    if greedy:
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    return {
        "do_sample": True,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": 0,  # off: only temperature and top_p shape the distribution
    }
