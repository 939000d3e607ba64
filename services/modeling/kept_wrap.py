"""A LoRA job's wrapped model, kept by a reused spare for its tenant's next job.

A trainer or rollout spare reused across one tenant's jobs (modeling/spare.py ``serve_jobs``)
hands each LoRA job its preloaded base model, which the job wraps with peft
(``get_peft_model`` changes the model in place). Reading the base from its files and wrapping
it again for the next job cost more than the rest of a one-step job (on the 2-core machine,
bench/start_latency.py: about half of each spare's CPU time). Instead the job leaves the
wrapped model on the ``PreloadedModel`` it took (``keep``); when the job ends well the spare
keeps it (``Preload.take_back``), and the next job asking for the same wrap (``WrapKey``: the
LoRA settings, dtype, device, gradient checkpointing) gets it back with its adapter made anew
(``reset_adapter``), never the last job's:

- the base weights are the files' still: a LoRA job trains only its adapter (peft freezes
  the rest; the rollout copies in only the trainer's trainable tensors);
- after seeding torch with the job's seed, the adapter's weights are drawn again in place as
  peft's ``update_layer`` draws them for ``get_peft_model`` (float32 adapters on the CPU: the
  draws and their order are the same), or else the adapter is dropped and added again through
  peft's own ``delete_adapter`` and ``add_adapter``, which makes the same layers: either way
  the policy, its optimizer and torch's random state are bit for bit those of a fresh process
  (tests/worker/test_kept_wrap.py compares them, and a trained step, both ways).

A model with any other adapter (roles) or asking another wrap is not reused: the job reads
the base from its files, as a cold process does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import peft
import structlog
import torch
from peft.tuners.lora import LoraLayer

from opentinker.services.modeling.adapters import peft_lora_config
from opentinker.services.modeling.preload import KeptWrap, PreloadedModel
from opentinker.spec import ModelSpec

log = structlog.get_logger(__name__)

ADAPTER = "default"  # the one adapter of a LoRA job (the weight sync's tensor names)


@dataclass(frozen=True)
class WrapKey:
    """What a wrapped model was made for: a job asking the same may reuse it."""

    lora: str  # the job's ModelSpec.lora as JSON
    dtype: str
    device: str
    gradient_checkpointing: bool = False


def wrap_key(
    spec: ModelSpec, *, dtype: torch.dtype, device: str, gradient_checkpointing: bool = False
) -> WrapKey:
    return WrapKey(spec.lora.model_dump_json(), str(dtype), device, gradient_checkpointing)


def keep(preloaded: PreloadedModel | None, model: torch.nn.Module, key: WrapKey) -> None:
    """Leave ``model`` (``preloaded.model`` wrapped for ``key``) for a reused spare's next job."""
    if preloaded is not None and isinstance(model, peft.PeftModel):
        preloaded.kept = KeptWrap(model, key)


def kept_for(preloaded: PreloadedModel | None, key: WrapKey) -> peft.PeftModel | None:
    """The wrapped model ``preloaded`` keeps, when it was wrapped for ``key`` and holds one
    adapter only; else None."""
    kept = preloaded.kept if preloaded is not None else None
    if kept is None or kept.wrapped_for != key or not isinstance(kept.model, peft.PeftModel):
        return None
    if set(kept.model.peft_config) != {ADAPTER}:
        return None
    return kept.model


def usable_base(preloaded: PreloadedModel | None) -> PreloadedModel | None:
    """``preloaded`` when its model is a plain base still (no job wrapped it), else None (a
    job that cannot reuse the wrap reads the base from its files)."""
    return preloaded if preloaded is not None and preloaded.kept is None else None


def reset_adapter(
    model: peft.PeftModel, spec: ModelSpec, seed: int | None, *, in_place: bool = True
) -> None:
    """Make ``model``'s adapter anew for ``spec.lora``, as ``get_peft_model`` after
    ``torch.manual_seed(seed)`` makes it on a fresh base (no seeding when ``seed`` is None):
    drawn again in place where that draws the same (``in_place``), else made again by peft."""
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    if in_place and all(_drawn_in_place(layer) for layer in layers):
        _redraw(model, layers, seed)
        return
    config = peft_lora_config(spec.lora)
    # get_peft_model names the base in the config (what adapter_config.json says); so here
    config.base_model_name_or_path = model.get_base_model().__dict__.get("name_or_path") or None
    model.delete_adapter(ADAPTER)
    if seed is not None:
        torch.manual_seed(seed)
    model.add_adapter(ADAPTER, config)
    model.set_adapter(ADAPTER)
    log.info("adapter_reset", seed=seed)


def _drawn_in_place(layer: LoraLayer) -> bool:
    """A linear layer's default adapter, float32 on the CPU, no bias: where get_peft_model
    draws its weights (peft's update_layer: two ``nn.Linear`` made, then A drawn again and B
    zeroed by ``reset_lora_parameters``), so drawing them again in place gives the same."""
    if ADAPTER not in layer.lora_A or ADAPTER not in layer.lora_B:
        return False
    a, b = layer.lora_A[ADAPTER], layer.lora_B[ADAPTER]
    if not isinstance(a, torch.nn.Linear) or not isinstance(b, torch.nn.Linear):
        return False
    if b.bias is not None or a.bias is not None or layer.lora_embedding_A:
        return False
    weights = (a.weight, b.weight)
    return all(w.device.type == "cpu" and w.dtype == torch.float32 for w in weights)


@torch.no_grad()
def _redraw(model: peft.PeftModel, layers: Sequence[LoraLayer], seed: int | None) -> None:
    """The draws of ``update_layer`` for each layer, in the order get_peft_model made them
    (the modules' order), into the weights there; no gradient left of the last job."""
    if seed is not None:
        torch.manual_seed(seed)
    init = cast("peft.LoraConfig", model.peft_config[ADAPTER]).init_lora_weights
    for layer in layers:
        a, b = layer.lora_A[ADAPTER], layer.lora_B[ADAPTER]
        assert isinstance(a, torch.nn.Linear) and isinstance(b, torch.nn.Linear)  # in place
        a.reset_parameters()  # as nn.Linear(in, r) draws when made
        b.reset_parameters()  # as nn.Linear(r, out)
        layer.reset_lora_parameters(ADAPTER, init)  # A drawn again, B zeroed
        a.weight.grad = b.weight.grad = None  # nothing of the last job's backward
    log.info("adapter_reset", seed=seed, in_place=True)
