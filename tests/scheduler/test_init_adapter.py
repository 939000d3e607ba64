"""A LoRA job's starting adapter: the trainer's policy and the rollout's engine load it alike,
so both serve the same weights before any sync (the probe agrees), and a misfit is named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.trainer.model.policy import Policy
from opentinker.spec import LoraConfig, ModelSpec

pytestmark = pytest.mark.integration

LORA = LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(base model folder, a saved adapter whose weights are far from a fresh one's)."""
    base = ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")
    torch.manual_seed(1)
    trained = Policy(ModelSpec(base_model=str(base), lora=LORA), learning_rate=1e-3)
    with torch.no_grad():
        for tensor in trained.trainable_state().values():
            tensor.normal_(0.0, 0.2)  # lora_B too: a fresh adapter has lora_B = 0
    folder = trained.save_checkpoint(tmp_path_factory.mktemp("sft") / "step-000010")
    return base, folder


def test_policy_and_engine_start_from_the_same_saved_adapter(adapter) -> None:
    base, folder = adapter
    spec = ModelSpec(base_model=str(base), lora=LORA, init_adapter=str(folder))
    policy = Policy(spec, learning_rate=1e-3, seed=5)
    engine = TransformersEngine.load(spec, device="cpu")
    saved = Policy(ModelSpec(base_model=str(base), lora=LORA), learning_rate=1e-3)
    saved.load_weights(folder)
    for name, tensor in saved.trainable_state().items():
        assert torch.equal(policy.trainable_state()[name], tensor), name

    ids = policy.probe_token_ids
    trainer_side = policy.probe_logprobs(ids)
    rollout_side = engine.logprobs_of(ids)
    assert max(abs(a - b) for a, b in zip(trainer_side, rollout_side, strict=True)) < 1e-5
    fresh = Policy(ModelSpec(base_model=str(base), lora=LORA), learning_rate=1e-3)
    # The adapter matters: a fresh one (lora_B = 0) gives the base model's logprobs.
    assert (
        max(abs(a - b) for a, b in zip(trainer_side, fresh.probe_logprobs(ids), strict=True)) > 1e-2
    )


def test_an_adapter_of_another_shape_is_refused_naming_both(adapter, tmp_path: Path) -> None:
    base, folder = adapter
    other = ModelSpec(base_model=str(base), lora=LoraConfig(rank=8), init_adapter=str(folder))
    with pytest.raises(ValueError, match="saved with rank 4.*has rank 8"):
        Policy(other, learning_rate=1e-3)
    with pytest.raises(ValueError, match="saved with rank 4.*has rank 8"):
        TransformersEngine.load(other, device="cpu")
    missing = ModelSpec(base_model=str(base), lora=LORA, init_adapter=str(tmp_path))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        Policy(missing, learning_rate=1e-3)
