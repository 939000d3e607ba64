"""The trainer and the rollout of one job pick device and dtype from the same lease by one
rule (placement.py), and the weight-sync probe tolerance follows the dtype pair."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opentinker.errors import ConfigError
from opentinker.services.modeling.placement import (
    Placement,
    placement_for_lease,
    placement_here,
    probe_tolerance,
)
from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.trainer.model.policy import Policy
from opentinker.spec import ModelSpec


def test_cuda_lease_is_bf16_on_the_first_visible_gpu() -> None:
    # The worker narrows CUDA_VISIBLE_DEVICES to the lease ("3,5"), so inside the job the
    # first leased GPU is cuda:0; two GPUs leased = two trainer ranks.
    placement = placement_for_lease(["h/cuda:3", "h/cuda:5"], cuda_available=True)
    assert placement == Placement("cuda:0", torch.bfloat16, num_devices=2)


def test_cpu_lease_and_no_lease_are_fp32_on_cpu() -> None:
    assert placement_for_lease(["h/cpu:0"], cuda_available=True) == Placement("cpu", torch.float32)
    assert placement_for_lease([], cuda_available=False) == Placement("cpu", torch.float32)


def test_override_keeps_the_dtype_rule_of_its_device() -> None:
    placement = placement_for_lease(["h/cpu:0"], cuda_available=True, override="cuda:1")
    assert (placement.device, placement.dtype) == ("cuda:1", torch.bfloat16)


def test_bad_leases_are_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match="mixes device kinds") as mixed:
        placement_for_lease(["h/cuda:0", "h/cpu:0"], cuda_available=True)
    assert mixed.value.reason == "MIXED_DEVICE_LEASE"
    with pytest.raises(ConfigError, match="sees none") as blind:
        placement_for_lease(["h/cuda:0"], cuda_available=False)
    assert blind.value.reason == "CUDA_UNAVAILABLE"


def test_probe_tolerance_per_dtype_pair() -> None:
    assert probe_tolerance(torch.float32, torch.float32) == 1e-3
    assert probe_tolerance(torch.float32, torch.float32, logit_scale=10.0) == 1e-3
    assert probe_tolerance(torch.bfloat16, torch.bfloat16) == 5e-2
    # bf16's error is relative to the logits: the tolerance follows their spread, floored
    assert probe_tolerance(torch.bfloat16, torch.bfloat16, logit_scale=0.1) == 5e-2
    assert probe_tolerance(torch.bfloat16, torch.float32, logit_scale=2.5) == pytest.approx(0.5)
    with pytest.raises(ConfigError, match="OPENTINKER_TRAINER_PROBE_TOLERANCE"):
        probe_tolerance(torch.float16, torch.bfloat16)


@pytest.mark.integration
def test_trainer_and_rollout_agree_from_the_same_lease(tmp_path: Path) -> None:
    """Both sides built as the job's processes build them, from one CPU lease: same device,
    same dtype, and the probe of the untouched weights agrees within that pair's tolerance."""
    model_dir = ensure_tiny_model(tmp_path / "tiny-qwen2")
    lease = ["worker-1/cpu:0"]
    spec = ModelSpec(base_model=str(model_dir), finetune="full")
    trainer_side = placement_here(lease)  # what services/trainer/service.py computes
    rollout_side = placement_here(lease)  # what services/rollout/__main__.py computes
    policy = Policy(spec, learning_rate=1e-3, device=trainer_side.device)
    engine = TransformersEngine.load(spec, device=rollout_side.device)
    trainer_param = next(policy.model.parameters())
    rollout_param = next(engine.model.parameters())
    assert (trainer_param.device, trainer_param.dtype) == (torch.device("cpu"), torch.float32)
    assert (rollout_param.device, rollout_param.dtype) == (
        trainer_param.device,
        trainer_param.dtype,
    )
    ids = policy.probe_token_ids
    diff = max(
        abs(a - b) for a, b in zip(policy.probe_logprobs(ids), engine.logprobs_of(ids), strict=True)
    )
    assert diff <= probe_tolerance(trainer_param.dtype, rollout_param.dtype)


def scaled_model(tmp_path: Path, factor: float) -> Path:
    """The tiny model with its final norm scaled by ``factor``: every logit scales with it,
    as a trained model's logits spread far wider than a random-init one's."""
    model_dir = ensure_tiny_model(tmp_path / "tiny-qwen2")
    spec = ModelSpec(base_model=str(model_dir), finetune="full")
    engine = TransformersEngine.load(spec, device="cpu")
    with torch.no_grad():
        engine.model.get_decoder().norm.weight.mul_(factor)
    engine.model.save_pretrained(tmp_path / "scaled")
    engine.tokenizer.save_pretrained(tmp_path / "scaled")
    return tmp_path / "scaled"


@pytest.mark.integration
def test_the_bf16_tolerance_follows_the_logits_spread(tmp_path: Path) -> None:
    """Logits spread like a trained model's (std ~6): a bf16 trainer and a float32 rollout of
    the SAME weights differ on the probe by more than a fixed 5e-2 (which failed every such
    sync), within the tolerance at the probe's logit scale; other weights are still refused."""
    spec = ModelSpec(base_model=str(scaled_model(tmp_path, 25.0)), finetune="full")
    policy = Policy(spec, learning_rate=1e-3, dtype=torch.bfloat16)
    rollout = TransformersEngine.load(spec, device="cpu")  # float32
    ids = policy.probe_token_ids
    probe = policy.probe(ids)
    assert 3.0 < probe.logit_scale < 12.0, probe.logit_scale
    tolerance = probe_tolerance(torch.bfloat16, torch.float32, probe.logit_scale)

    def diff() -> float:
        pairs = zip(probe.logprobs, rollout.logprobs_of(ids), strict=True)
        return max(abs(a - b) for a, b in pairs)

    same = diff()
    assert 5e-2 < same <= tolerance, (same, tolerance)
    with torch.no_grad():  # one layer's MLP is another model's: a wrong weight
        torch.manual_seed(1)
        mlp = rollout.model.get_decoder().layers[0].mlp.down_proj.weight
        mlp.copy_(torch.randn_like(mlp) * mlp.std())
    assert diff() > tolerance, (diff(), tolerance)
