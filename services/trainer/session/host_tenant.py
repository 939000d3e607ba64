"""One session's view of a shared LoRA host: its adapter, its AdamW, its RNG.

``TenantPolicy`` answers what a ``TrainingSession`` asks of its ``Policy`` (the logprobs of a
batch, the optimizer step, the trainable state under the trainer's tensor names, the weight-sync
probe), each inside ``host.activated(session)``: the session's adapter active and the only one
trainable, the RNG its own. Its tensor names are those a one-session policy gives the adapter
(``...lora_A.default.weight``), so weight sync, snapshots and the rollout's shared engine take
them unchanged.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

from opentinker.services.trainer.model.logprobs import (
    causal_lm_parts,
    hidden_states,
    logit_softcap,
    logprobs_from_hidden,
)
from opentinker.services.trainer.model.master_weights import MasterWeightAdamW
from opentinker.services.trainer.model.policy import (
    ADAMW_WEIGHT_DECAY,
    PROBE_LENGTH,
    PROBE_MESSAGES,
    Probe,
)
from opentinker.services.trainer.rl.batch import SequenceBatch
from opentinker.spec import ModelSpec

if TYPE_CHECKING:
    from opentinker.services.trainer.session.host import SharedLoraHost

RngState = tuple[torch.Tensor, torch.Tensor | None]  # (CPU, GPU or None)
TRAINER_ADAPTER = "default"  # the adapter name in a one-session policy's tensor names


def adapter_name_for(session_id: str) -> str:
    """A session's adapter name: peft module keys may not contain dots."""
    return "s_" + re.sub(r"[^A-Za-z0-9_]", "_", session_id)


def probe_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The weight-sync probe's ids, as ``Policy`` makes them."""
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(PROBE_MESSAGES, tokenize=True, return_dict=False)
    else:
        ids = tokenizer.encode(" ".join(m["content"] for m in PROBE_MESSAGES))
    return [int(i) for i in list(ids)[:PROBE_LENGTH]]


def adapter_parameters(model: torch.nn.Module, adapter: str) -> dict[str, torch.nn.Parameter]:
    """``adapter``'s parameters under a one-session policy's names:
    ``...q_proj.lora_A.<adapter>.weight`` -> ``...q_proj.lora_A.default.weight``."""
    pattern = re.compile(rf"\.(lora_\w+)\.{re.escape(adapter)}(?=\.|$)")
    return {
        pattern.sub(rf".\1.{TRAINER_ADAPTER}", name): param
        for name, param in model.named_parameters()
        if pattern.search(name)
    }


class TenantPolicy:
    """A session's adapter on ``host`` (see the module docstring)."""

    is_lora = True
    role_adapters: tuple[str, ...] = ()

    def __init__(
        self,
        host: SharedLoraHost,
        *,
        session_id: str,
        adapter: str,
        spec: ModelSpec,
        rng_state: RngState,
    ) -> None:
        assert host.model is not None, "the host wraps its base with the first adapter"
        self._host, self.session_id, self.adapter, self.spec = host, session_id, adapter, spec
        self.model = host.model
        self.tokenizer = host.tokenizer
        self.device, self.dtype = host.device, host.dtype
        self.probe_token_ids = host.probe_token_ids
        self.rng_state = rng_state
        self._params = adapter_parameters(host.model, adapter)
        if not self._params:
            raise ValueError(f"adapter {adapter!r}: no LoRA parameters (no target module found)")
        self.optimizer: torch.optim.AdamW = MasterWeightAdamW(
            list(self._params.values()), lr=1e-5, weight_decay=ADAMW_WEIGHT_DECAY
        )

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return list(self._params.values())

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self._params.values())

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Trainer name -> detached tensor of each of this session's adapter parameters."""
        return {name: p.detach() for name, p in self._params.items()}

    def token_logprobs_and_entropy(
        self,
        batch: SequenceBatch,
        *,
        temperature: float = 1.0,
        targets_B_T: torch.Tensor | None = None,
        wanted_B_T: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``Policy.token_logprobs_and_entropy``, through this session's adapter."""
        with self._host.activated(self.session_id):
            tokens_B_L = batch.tokens_B_L.to(self.device)
            hidden_B_L_H = hidden_states(
                self.model, tokens_B_L, batch.attention_mask_B_L.to(self.device)
            )
            _, head = causal_lm_parts(self.model)
            return logprobs_from_hidden(
                head,
                hidden_B_L_H,
                tokens_B_L,
                temperature=temperature,
                softcap=logit_softcap(self.model),
                targets_B_T=None if targets_B_T is None else targets_B_T.to(self.device),
                wanted_B_T=None if wanted_B_T is None else wanted_B_T.to(self.device),
            )

    def optimizer_step(self, max_grad_norm: float) -> float:
        """Clip this session's gradients to ``max_grad_norm`` (inf: none), step its AdamW,
        zero them; the norm before clipping."""
        with self._host.activated(self.session_id):
            params = self.trainable_parameters()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or math.inf)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return float(grad_norm)

    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        return self.probe(token_ids).logprobs

    @torch.no_grad()
    def probe(self, token_ids: list[int]) -> Probe:
        """As ``Policy.probe``: eval mode, temperature 1, this session's adapter."""
        with self._host.activated(self.session_id):
            self.model.eval()
            try:
                ids_1_L = torch.tensor([token_ids], dtype=torch.long, device=self.device)
                logits_T_V = self.model(input_ids=ids_1_L).logits.float()[0, :-1]
                logp_T_V = torch.log_softmax(logits_T_V, dim=-1)
                logprobs = logp_T_V.gather(-1, ids_1_L[0, 1:].unsqueeze(-1)).squeeze(-1)
                scale = (
                    logits_T_V.std(dim=-1).square().mean().sqrt().item()
                    if len(ids_1_L[0]) > 1
                    else 0.0
                )
                return Probe(logprobs.tolist(), scale)
            finally:
                self.model.train()
