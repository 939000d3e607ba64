"""Gradient checkpointing of the transformer layers: less saved activation, the same gradients."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.rl.batch import Episode, SequenceBatch, collate
from opentinker.spec import JobSpec, LoraConfig, ModelSpec, RlConfig, from_proto, to_proto

pytestmark = pytest.mark.integration  # real tiny model on disk, loaded with from_pretrained


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


def batch_of(pad_id: int) -> SequenceBatch:
    rows = [list(range(40, 60)), list(range(100, 112))]
    episodes = [
        Episode(0, 0, ids, 4, [0.0] * (len(ids) - 4), [1] * (len(ids) - 4), 0.0, False)
        for ids in rows
    ]
    return collate(episodes, pad_id)


def gradients_and_saved_bytes(policy: Policy, batch: SequenceBatch) -> tuple[dict, int]:
    """One masked-mean-logprob backward; the bytes autograd saved for it in the forward."""
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs_B_T, _ = policy.token_logprobs_and_entropy(batch)
    mask_B_T = batch.loss_mask_B_T
    (-(logprobs_B_T * mask_B_T).sum() / mask_B_T.sum()).backward()
    grads = {n: p.grad for n, p in policy.model.named_parameters() if p.grad is not None}
    return grads, sum(saved)


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_checkpointed_layers_give_the_same_gradients(tiny_model_dir: Path, finetune: str) -> None:
    def policy(checkpointing: bool) -> Policy:
        torch.manual_seed(0)  # the same LoRA init in both
        spec = ModelSpec(
            base_model=str(tiny_model_dir),
            finetune=finetune,
            lora=LoraConfig(rank=4),
            gradient_checkpointing=checkpointing,
        )
        return Policy(spec, learning_rate=1e-3, seed=0)

    plain, checkpointed = policy(False), policy(True)
    assert (
        checkpointed.model.is_gradient_checkpointing and not plain.model.is_gradient_checkpointing
    )
    batch = batch_of(plain.pad_id)
    plain_grads, plain_saved = gradients_and_saved_bytes(plain, batch)
    ckpt_grads, ckpt_saved = gradients_and_saved_bytes(checkpointed, batch)
    assert plain_grads.keys() == ckpt_grads.keys() and plain_grads
    if finetune == "lora":  # lora_B starts at zero: only lora_B has a gradient on step one
        assert any("lora_B" in n and g.abs().sum() > 0 for n, g in ckpt_grads.items())
    for name, grad in plain_grads.items():
        assert torch.allclose(ckpt_grads[name], grad, atol=1e-6), name
    # the layers' insides are recomputed, not saved: far less is kept from the forward pass
    assert ckpt_saved < plain_saved / 2, (ckpt_saved, plain_saved)


def test_gradient_checkpointing_travels_on_the_wire() -> None:
    spec = JobSpec(
        name="memory",
        model=ModelSpec(base_model="m", gradient_checkpointing=True),
        rl=RlConfig(env_name="letter"),
    )
    pb = to_proto(spec)
    assert pb.model.gradient_checkpointing is True
    assert from_proto(pb).model.gradient_checkpointing is True
    plain = spec.model_copy(update={"model": ModelSpec(base_model="m")})
    assert from_proto(to_proto(plain)).model.gradient_checkpointing is False
