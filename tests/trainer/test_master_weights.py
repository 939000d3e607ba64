"""bfloat16 weights keep updates smaller than their rounding step in float32 masters
(services/trainer/model/master_weights.py): with plain AdamW such updates are lost."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opentinker import LoraConfig, ModelSpec
from opentinker.services.trainer.model.master_weights import MASTERS_KEY, MasterWeightAdamW
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.session.state import SavedSession, load_state, save_state

pytestmark = pytest.mark.unit

LR = 1e-6  # the order of full fine-tuning's RL learning rates; bf16's step at 0.02 is 1.2e-4


def linear(dtype: torch.dtype) -> torch.nn.Linear:
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16, bias=False)
    with torch.no_grad():
        layer.weight.normal_(0.0, 0.02)
    return layer.to(dtype)


def train(layer: torch.nn.Linear, optimizer: torch.optim.Optimizer, steps: int) -> None:
    """``steps`` updates with the same gradient (all ones: AdamW moves every weight by ~lr)."""
    for _ in range(steps):
        layer.weight.grad = torch.ones_like(layer.weight)
        optimizer.step()
        optimizer.zero_grad()


def test_plain_adamw_loses_small_bf16_updates_and_the_masters_keep_them() -> None:
    plain, mastered = linear(torch.bfloat16), linear(torch.bfloat16)
    reference = linear(torch.bfloat16).float()  # the same start, stepped in float32
    start = plain.weight.detach().clone()
    train(plain, torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.0), 300)
    # 300 steps of 1e-6 each: every one rounded away wherever the step is under half of
    # bf16's there (|w| >= 1e-3: 2^-18 and up), which is nearly every weight.
    large = start.abs() >= 1e-3
    assert large.float().mean() > 0.9 and torch.equal(plain.weight[large], start[large])
    optimizer = MasterWeightAdamW(mastered.parameters(), lr=LR, weight_decay=0.0)
    train(mastered, optimizer, 300)
    # The bf16 weights are the float32 run's, rounded: 3e-4 in all, past bf16's step at 0.02.
    train(reference, torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0), 300)
    assert torch.equal(mastered.weight, reference.weight.to(torch.bfloat16))
    assert (mastered.weight[large] != start[large]).float().mean() > 0.5
    assert mastered.weight.grad is None  # zero_grad reaches the model's own gradients


def test_float32_parameters_are_stepped_as_by_plain_adamw() -> None:
    ours, plain = linear(torch.float32), linear(torch.float32)
    optimizer = MasterWeightAdamW(ours.parameters(), lr=1e-3)
    train(ours, optimizer, 3)
    train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3), 3)
    assert torch.equal(ours.weight, plain.weight)
    assert MASTERS_KEY not in optimizer.state_dict()  # a checkpoint as plain AdamW writes it


def test_a_resumed_optimizer_continues_from_the_masters_not_the_rounded_weights(
    tmp_path: Path,
) -> None:
    through, first = linear(torch.bfloat16), linear(torch.bfloat16)
    optimizer = MasterWeightAdamW(through.parameters(), lr=LR, weight_decay=0.0)
    train(through, optimizer, 200)
    saved = MasterWeightAdamW(first.parameters(), lr=LR, weight_decay=0.0)
    train(first, saved, 100)
    torch.save({"weight": first.weight.detach(), "optimizer": saved.state_dict()}, tmp_path / "c")
    checkpoint = torch.load(tmp_path / "c")
    resumed = linear(torch.bfloat16)
    with torch.no_grad():
        resumed.weight.copy_(checkpoint["weight"])
    again = MasterWeightAdamW(resumed.parameters(), lr=LR, weight_decay=0.0)
    again.load_state_dict(checkpoint["optimizer"])
    train(resumed, again, 100)
    assert torch.equal(resumed.weight, through.weight)
    other = torch.nn.Linear(16, 16, bias=True)  # two float32 parameters: the one master fits none
    wrong = MasterWeightAdamW(other.parameters(), lr=LR)
    start = other.weight.detach().clone()
    with pytest.raises(ValueError, match="1 float32 masters, this policy has 0"):
        wrong.load_state_dict(checkpoint["optimizer"])
    assert torch.equal(other.weight, start) and not wrong.state  # refused before any change


def test_a_session_state_saved_in_bf16_loads_into_a_float32_policy_exactly(
    letter_model_dir: Path, tmp_path: Path
) -> None:
    """A state saved by a bf16 trainer (CUDA) loads into a float32 one (CPU): its float32
    masters become the weights. It was refused (26 masters, 0 low-precision parameters)
    after the weights and AdamW moments had been overwritten: a failed load_state that had
    changed the session anyway."""
    spec = ModelSpec(base_model=str(letter_model_dir), finetune="full")
    saved = Policy(spec, learning_rate=1e-3, dtype=torch.bfloat16)
    for p in saved.trainable_parameters():
        p.grad = torch.full_like(p, 0.5)
    saved.optimizer_step(1.0)
    owner = SavedSession(tenant_id="acme", job_id="job-gpu", model=spec, step=1)
    path = save_state(saved, root=tmp_path, name="bf16", owner=owner)
    loaded = Policy(spec, learning_rate=1e-3)
    assert load_state(loaded, str(path), root=tmp_path, tenant_id="acme").step == 1
    masters = saved.optimizer.state_dict()[MASTERS_KEY]
    for weight, master in zip(loaded.trainable_parameters(), masters, strict=True):
        assert weight.dtype == torch.float32 and torch.equal(weight, master)
    moments = [s["exp_avg_sq"] for s in loaded.optimizer.state_dict()["state"].values()]
    expected = [s["exp_avg_sq"] for s in saved.optimizer.state_dict()["state"].values()]
    assert len(moments) == len(masters)
    for got, want in zip(moments, expected, strict=True):
        assert torch.equal(got, want)


def test_a_bf16_full_fine_tune_steps_masters_and_a_lora_one_keeps_float32_adapters(
    letter_model_dir: Path,
) -> None:
    full = Policy(
        ModelSpec(base_model=str(letter_model_dir), finetune="full"),
        learning_rate=LR,
        dtype=torch.bfloat16,
    )
    weights = full.trainable_parameters()
    assert {p.dtype for p in weights} == {torch.bfloat16}
    masters = full.optimizer.state_dict()[MASTERS_KEY]
    assert len(masters) == len(weights) and {m.dtype for m in masters} == {torch.float32}
    lora = Policy(
        ModelSpec(base_model=str(letter_model_dir), finetune="lora", lora=LoraConfig(rank=4)),
        learning_rate=LR,
        dtype=torch.bfloat16,
    )
    assert {p.dtype for p in lora.trainable_parameters()} == {torch.float32}  # peft's choice
    assert MASTERS_KEY not in lora.optimizer.state_dict()


def test_a_copied_optimizer_steps_the_copied_weights_through_its_own_masters() -> None:
    """copy.deepcopy (a policy's twin) keeps each parameter paired with its master."""
    import copy

    layer = linear(torch.bfloat16)
    optimizer = MasterWeightAdamW(layer.parameters(), lr=LR, weight_decay=0.0)
    twin_layer, twin = copy.deepcopy((layer, optimizer))
    train(twin_layer, twin, 300)
    train(layer, optimizer, 300)
    assert torch.equal(twin_layer.weight, layer.weight)
    assert not torch.equal(twin_layer.weight, linear(torch.bfloat16).weight)
