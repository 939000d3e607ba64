"""One LoRA adapter per role (multi-agent self-play), the same way in the trainer and the rollout.

The job's LoRA (peft's ``default`` adapter, as ``get_peft_model`` made it) is replaced by one
named adapter per role with the same config: its tensors are named
``...q_proj.lora_A.<role>.weight``, so a weight update carries every role's adapter and says
which is which. One adapter is active at a time (``activate``): the trainer activates a role
for the forward and backward passes of that role's trajectories, the rollout engine for the
engine call of that role's phase. Every role's parameters stay trainable whichever is active
(peft would freeze the inactive ones), so the trainer's optimizer and weight export hold them
all; an inactive adapter gets no gradient, and AdamW leaves a parameter without one untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import peft
from transformers import PreTrainedModel

_T = TypeVar("_T")


def add_role_adapters(model: PreTrainedModel, roles: Sequence[str]) -> None:
    """Replace the model's ``default`` LoRA adapter by one adapter per role (same config,
    fresh weights: B = 0, so every role starts as the base model); the first role is active."""
    if not isinstance(model, peft.PeftModel):
        raise ValueError("one adapter per role needs a LoRA model (finetune 'lora')")
    if len(roles) < 2 or len(set(roles)) != len(roles):
        raise ValueError(f"one adapter per role needs two or more distinct roles, got {roles}")
    config = model.peft_config["default"]
    for role in roles:
        model.add_adapter(role, config)
    model.set_adapter(roles[0])
    model.delete_adapter("default")
    activate(model, roles[0], roles)


def activate(model: PreTrainedModel, role: str, roles: Sequence[str]) -> None:
    """Serve and train through ``role``'s adapter; every role's adapter stays trainable."""
    assert isinstance(model, peft.PeftModel), "role adapters live on a peft model"
    model.set_adapter(role)
    markers = tuple(f".{r}." for r in roles)
    for name, param in model.named_parameters():
        if "lora_" in name and any(m in name for m in markers):
            param.requires_grad_(True)


def each_role(model: PreTrainedModel, roles: Sequence[str], fn: Callable[[], list[_T]]) -> list[_T]:
    """``fn()`` under each role's adapter in turn, results concatenated in role order (the
    weight-sync probe: every role's adapter is checked); the first role is active after."""
    out: list[_T] = []
    for role in roles:
        activate(model, role, roles)
        out.extend(fn())
    activate(model, roles[0], roles)
    return out
