"""The policy the trainer owns: tokenizer, model (LoRA via peft, or all parameters), AdamW.

Loaded through ``from_pretrained`` like any Hugging Face checkpoint, in the dtype its device
calls for (``placement.dtype_for_device``: float32 on CPU, bfloat16 on CUDA), the same rule
the rollout's engine follows, so both serve the same numbers. The rollout
builds the same model the same way (same base, same peft ``LoraConfig``), so the names of
``trainable_state()`` are the names it loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from opentinker.errors import ConfigError
from opentinker.services.modeling.adapters import (
    load_adapter_weights,
    load_init_adapter,
    peft_lora_config,
)
from opentinker.services.modeling.kept_wrap import (
    keep,
    kept_for,
    reset_adapter,
    usable_base,
    wrap_key,
)
from opentinker.services.modeling.model_card import write_blank_card
from opentinker.services.modeling.placement import dtype_for_device, probe_tolerance
from opentinker.services.modeling.preload import PreloadedModel
from opentinker.services.modeling.role_adapters import activate, add_role_adapters, each_role
from opentinker.services.modeling.template_choice import use_chat_template
from opentinker.services.modeling.vision_inputs import load_image_processor, load_language_model
from opentinker.services.trainer.model.logprobs import (
    causal_lm_parts,
    hidden_states,
    logit_softcap,
    logprobs_from_hidden,
    token_logprobs_and_entropy,
)
from opentinker.services.trainer.model.master_weights import MasterWeightAdamW
from opentinker.services.trainer.model.vision_logprobs import vision_hidden_states
from opentinker.services.trainer.rl.batch import SequenceBatch
from opentinker.spec import ModelSpec

# The probe that proves the rollout serves the trainer's weights: the first PROBE_LENGTH ids
# of this conversation, tokenized with the model's own chat template.
PROBE_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Weight-sync probe: say the alphabet."},
]
PROBE_LENGTH = 32
ADAMW_WEIGHT_DECAY = 0.0  # RL fine-tuning runs usually keep the base weights un-decayed.


def enable_gradient_checkpointing(model: PreTrainedModel, *, lora: bool) -> None:
    """Recompute each transformer layer's activations in the backward pass (train mode only).

    Non-reentrant checkpointing: gradients reach parameters inside a layer even when the
    layer's input does not require grad. With LoRA the embeddings are frozen, so the input
    of the first layer is made to require grad too, as peft asks for reentrant callers.
    """
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        model.enable_input_require_grads()


@dataclass(frozen=True)
class Probe:
    """The trainer's answer to the weight-sync probe: each token's logprob, and the logits'
    scale (the RMS over positions of their std over the vocabulary), which sets how far a
    narrow dtype's rounding moves the logprobs (placement.probe_tolerance)."""

    logprobs: list[float]
    logit_scale: float


class Policy:
    """A causal LM with its tokenizer and optimizer, on CPU (or ``device``), in the dtype the
    device calls for (``dtype_for_device``)."""

    def __init__(
        self,
        model_spec: ModelSpec,
        *,
        learning_rate: float,
        device: str = "cpu",
        preloaded: PreloadedModel | None = None,
        seed: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """``preloaded``: ``model_spec.base_model`` already read by a warm spare (used as is,
        never shared with another policy), or the model a reused spare's last LoRA job wrapped
        (kept_wrap.py: its adapter is made anew). ``seed``: torch's RNG is seeded right before
        the LoRA weights are drawn, so a policy is the same whether its base was preloaded,
        kept or not. ``dtype``: the device's (``dtype_for_device``) unless given."""
        self.spec = model_spec
        self.device = torch.device(device)
        self.dtype = dtype or dtype_for_device(device)
        key = wrap_key(
            model_spec,
            dtype=self.dtype,
            device=str(self.device),
            gradient_checkpointing=model_spec.gradient_checkpointing,
        )
        kept = kept_for(preloaded, key) if self.is_lora else None
        self.reused = kept is not None  # the last job's wrapped model, its adapter made anew
        if kept is None:
            preloaded = usable_base(preloaded) or PreloadedModel(
                model_spec.base_model,
                AutoTokenizer.from_pretrained(model_spec.base_model),
                load_language_model(model_spec.base_model, dtype=self.dtype),
            )
        assert preloaded is not None
        self.tokenizer: PreTrainedTokenizerBase = preloaded.tokenizer
        use_chat_template(self.tokenizer, model_spec.chat_template)  # the job's choice, if any
        self.image_processor = load_image_processor(model_spec.base_model)  # None: text only
        if kept is not None:
            reset_adapter(kept, model_spec, seed)
            self.model: PreTrainedModel = kept  # type: ignore[assignment]  # a PeftModel
        else:
            self.model = self._wrapped(preloaded.model, seed)
            keep(preloaded, self.model, key)  # a reused spare's next job may take it
        load_init_adapter(self.model, model_spec, self.device)  # LoRA from a saved adapter
        self.model.train()
        _, self._head = causal_lm_parts(self.model)
        # Sharded over ranks (distributed.py): hidden states come through the root module's
        # forward, which gathers the root's sharded parameters (embeddings, norm, head).
        self.hidden_through_root = False
        # Positions per logits chunk; None: as many as fit LOGIT_CHUNK_ELEMENTS (logprobs.py).
        self.logit_chunk_positions: int | None = None
        # bfloat16 weights are stepped through float32 masters (master_weights.py).
        self.optimizer: torch.optim.AdamW = MasterWeightAdamW(
            self.trainable_parameters(), lr=learning_rate, weight_decay=ADAMW_WEIGHT_DECAY
        )
        self.probe_token_ids: list[int] = self._probe_ids()
        # Multi-agent self-play with one adapter per role (``use_role_adapters``); () = one.
        self.role_adapters: tuple[str, ...] = ()
        if not self.reused:  # a kept model passed this check when it was wrapped
            self._check_chunked_logprobs()

    def use_role_adapters(self, roles: tuple[str, ...]) -> None:
        """One LoRA adapter per role from now on (role_adapters.py), before any training:
        the optimizer is rebuilt over every role's adapter with the same settings."""
        add_role_adapters(self.model, roles)
        self.role_adapters = tuple(roles)
        group = self.optimizer.param_groups[0]
        self.optimizer = MasterWeightAdamW(
            self.trainable_parameters(),
            lr=group["lr"],
            betas=group["betas"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
        )

    def activate_role(self, role: str) -> None:
        """Forward and backward passes go through ``role``'s adapter."""
        if role not in self.role_adapters:
            raise ValueError(f"no adapter for role {role!r}; the roles are {self.role_adapters}")
        activate(self.model, role, self.role_adapters)

    @property
    def is_lora(self) -> bool:
        return self.spec.finetune == "lora"

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    def _wrapped(self, base: PreTrainedModel, seed: int | None) -> PreTrainedModel:
        """``base`` in the policy's dtype, wrapped (LoRA) with its adapter drawn after
        ``seed``, on the policy's device."""
        # transformers types .to() narrowly (functools.wraps of the unbound method).
        base = base.to(dtype=self.dtype)  # type: ignore[call-arg]  # spare: float32
        if seed is not None:
            torch.manual_seed(seed)
        if self.spec.gradient_checkpointing:
            enable_gradient_checkpointing(base, lora=self.is_lora)
        if self.is_lora:
            # PeftModel forwards every PreTrainedModel method (generate, named_parameters, ...)
            base = get_peft_model(base, peft_lora_config(self.spec.lora))  # type: ignore[assignment]
        return base.to(self.device)  # type: ignore[arg-type]

    def _probe_ids(self) -> list[int]:
        if self.tokenizer.chat_template:
            ids = self.tokenizer.apply_chat_template(
                PROBE_MESSAGES, tokenize=True, return_dict=False
            )
        else:
            ids = self.tokenizer.encode(" ".join(m["content"] for m in PROBE_MESSAGES))
        return [int(i) for i in list(ids)[:PROBE_LENGTH]]

    @torch.no_grad()
    def _check_chunked_logprobs(self) -> None:
        """Training reads the body's hidden states and applies the head itself (logprobs.py);
        a model whose own forward does more to its logits (a scale, a cap not applied there)
        would train on other numbers than it samples from: refuse it here, at start."""
        was_training = self.model.training
        self.model.eval()
        try:
            ids_1_L = torch.tensor([self.probe_token_ids], device=self.device)
            chunked_1_T, _ = token_logprobs_and_entropy(
                self.model, ids_1_L, torch.ones_like(ids_1_L)
            )
        finally:
            self.model.train(was_training)
        forward = self.probe(self.probe_token_ids)
        gap = chunked_1_T[0].cpu() - torch.tensor(forward.logprobs)
        # The probe's tolerance for this dtype on both sides: float32 agrees to ~1e-6 (held
        # to 1e-3); bf16 logits round differently as the head's matmul changes shape.
        if gap.abs().max() > probe_tolerance(self.dtype, self.dtype, forward.logit_scale):
            raise ConfigError(
                f"model {self.spec.base_model} ({type(self.model).__name__}): logprobs from its "
                f"hidden states and output head differ from its own forward by "
                f"{gap.abs().max():.2e}; its architecture is not supported for training",
                reason="UNSUPPORTED_MODEL",
            )

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.trainable_parameters())

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Name -> detached tensor of every trainable parameter (LoRA: the adapter only)."""
        return {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}

    def hidden_states(self, batch: SequenceBatch) -> torch.Tensor:
        """The final hidden states ``[B, L, H]`` of the model's body for ``batch`` (with
        gradient), what the output head reads; a value head can read the same ones."""
        if batch.images:
            return vision_hidden_states(
                self.model,
                self.image_processor,
                batch.tokens_B_L.to(self.device),
                batch.attention_mask_B_L.to(self.device),
                batch.images,
            )
        if self.hidden_through_root:
            out = self.model(
                input_ids=batch.tokens_B_L.to(self.device),
                attention_mask=batch.attention_mask_B_L.to(self.device),
                output_hidden_states=True,
                logits_to_keep=1,  # the head runs in chunks afterwards (logprobs.py)
                use_cache=False,
            )
            return out.hidden_states[-1]
        return hidden_states(
            self.model,
            batch.tokens_B_L.to(self.device),
            batch.attention_mask_B_L.to(self.device),
        )

    def logprobs_from_hidden(
        self,
        batch: SequenceBatch,
        hidden_B_L_H: torch.Tensor,
        *,
        temperature: float = 1.0,
        targets_B_T: torch.Tensor | None = None,
        wanted_B_T: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``token_logprobs_and_entropy`` from hidden states already computed for ``batch``."""
        return logprobs_from_hidden(
            self._head,
            hidden_B_L_H,
            batch.tokens_B_L.to(self.device),
            temperature=temperature,
            chunk_positions=self.logit_chunk_positions,
            softcap=logit_softcap(self.model),
            targets_B_T=None if targets_B_T is None else targets_B_T.to(self.device),
            wanted_B_T=None if wanted_B_T is None else wanted_B_T.to(self.device),
        )

    def token_logprobs_and_entropy(
        self,
        batch: SequenceBatch,
        *,
        temperature: float = 1.0,
        targets_B_T: torch.Tensor | None = None,
        wanted_B_T: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next-token logprobs ``[B, T]`` (with gradient) and entropies ``[B, T]`` (detached).

        Position t holds log p(token t+1 | tokens 0..t) under softmax(logits / temperature),
        the distribution the rollout sampled from; entropy is of that distribution at t.
        Values at padded positions are meaningless: multiply by ``batch.loss_mask_B_T``.
        Computed in chunks of positions (see logprobs.py): the logits of the whole batch are
        never held, in the forward or the backward pass. ``targets_B_T``: the token each
        position's logprob is of, when not the next one (Tinker's target_tokens).
        ``wanted_B_T``: the positions read (0 elsewhere; the head runs there only).
        """
        hidden_B_L_H = self.hidden_states(batch)
        return self.logprobs_from_hidden(
            batch,
            hidden_B_L_H,
            temperature=temperature,
            targets_B_T=targets_B_T,
            wanted_B_T=wanted_B_T,
        )

    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        return self.probe(token_ids).logprobs

    @torch.no_grad()
    def probe(self, token_ids: list[int]) -> Probe:
        """logprob(ids[i+1] | ids[:i+1]) for each i, in eval mode (no dropout), temperature 1,
        and the logits' scale. With one adapter per role: those of every role's adapter, in
        role order (the largest scale)."""
        if not self.role_adapters:
            return self._probe(token_ids)
        probes = each_role(self.model, self.role_adapters, lambda: [self._probe(token_ids)])
        return Probe(
            [logprob for probe in probes for logprob in probe.logprobs],
            max(probe.logit_scale for probe in probes),
        )

    def _probe(self, token_ids: list[int]) -> Probe:
        was_training = self.model.training
        self.model.eval()
        try:
            ids_1_L = torch.tensor([token_ids], dtype=torch.long, device=self.device)
            logits_T_V = self.model(input_ids=ids_1_L).logits.float()[0, :-1]
            logp_T_V = torch.log_softmax(logits_T_V, dim=-1)
            logprobs = logp_T_V.gather(-1, ids_1_L[0, 1:].unsqueeze(-1)).squeeze(-1).tolist()
            scale = logits_T_V.std(dim=-1).square().mean().sqrt().item() if logprobs else 0.0
            return Probe(logprobs, scale)
        finally:
            self.model.train(was_training)

    def optimizer_step(self, max_grad_norm: float) -> float:
        """Clip gradients to ``max_grad_norm``, step AdamW, zero the gradients.

        Returns the gradient norm before clipping.
        """
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if hasattr(grad_norm, "full_tensor"):  # sharded (distributed.py): a DTensor
            grad_norm = grad_norm.full_tensor()
        return float(grad_norm)

    def save_checkpoint(self, out_dir: Path, *, trainer_state: dict | None = None) -> Path:
        """Save in Hugging Face format: the adapter (LoRA) or the whole model, plus the tokenizer.

        LoRA: ``adapter_config.json`` + ``adapter_model.safetensors``, loadable with
        ``PeftModel.from_pretrained(base, out_dir)``; full: loadable with
        ``AutoModelForCausalLM.from_pretrained(out_dir)``. ``trainer_state`` (step, version)
        goes to ``trainer_state.json`` beside them.
        """
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if self.is_lora:  # peft fills in this card rather than render its template each save
            write_blank_card(out_dir)
        self.model.save_pretrained(out_dir)
        self.tokenizer.save_pretrained(out_dir)
        if trainer_state is not None:
            (out_dir / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
        return out_dir.resolve()

    def load_weights(self, directory: Path) -> None:
        """Load the weights ``save_checkpoint`` wrote into this policy's model, in place (the
        optimizer keeps pointing at the same parameters). Raises ValueError when the saved
        tensors do not fit this model's trainable parameters."""
        directory = Path(directory)
        if self.role_adapters:
            unexpected, missing = self._load_role_adapters(directory)
        elif self.is_lora:
            loaded = load_adapter_weights(self.model, directory, self.device)
            unexpected = list(loaded.unexpected_keys)
            missing = [k for k in loaded.missing_keys if "lora_" in k]
        else:
            saved = AutoModelForCausalLM.from_pretrained(directory, dtype=self.dtype)
            loaded = self.model.load_state_dict(saved.state_dict(), strict=False)
            unexpected, missing = list(loaded.unexpected_keys), list(loaded.missing_keys)
        if unexpected or missing:
            raise ValueError(
                f"checkpoint {directory} does not fit the model: missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}"
            )

    def _load_role_adapters(self, directory: Path) -> tuple[list[str], list[str]]:
        """Each role's adapter from ``<directory>/<role>/`` (where peft saves a named adapter);
        returns (unexpected, missing) tensor names."""
        unexpected: list[str] = []
        missing: list[str] = []
        for role in self.role_adapters:
            loaded = load_adapter_weights(
                self.model, directory / role, self.device, adapter_name=role
            )
            unexpected += list(loaded.unexpected_keys)
            missing += [k for k in loaded.missing_keys if "lora_" in k and f".{role}." in k]
        return unexpected, missing
