"""A reused spare's kept LoRA model (modeling/kept_wrap.py): the next job's policy is bit for
bit the one a fresh process builds, whatever the last job trained; anything that asks another
wrap, or a full fine-tune, reads the base from its files. Real tiny Qwen2, real peft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from opentinker.services.modeling.preload import Preload, load_base
from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.trainer.model.policy import Policy
from opentinker.spec import LoraConfig, ModelSpec

LR = 5e-2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("kept") / "tiny-qwen2")


def train_a_step(policy: Policy) -> None:
    """One large AdamW step on the probe: every adapter tensor moves."""
    ids_1_L = torch.tensor([policy.probe_token_ids])
    loss = policy.model(input_ids=ids_1_L).logits.float().pow(2).mean()
    loss.backward()
    policy.optimizer_step(max_grad_norm=1e9)


def state(policy: Policy) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in policy.trainable_state().items()}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def job_on(preload: Preload, spec: ModelSpec, seed: int) -> Policy:
    """One job of a reused spare: take the preloaded model, build the policy, hand it back."""
    torch.manual_seed(seed)  # as service._train does before the policy
    policy = Policy(spec, learning_rate=LR, preloaded=preload.take(spec.base_model), seed=seed)
    return policy


def fresh(spec: ModelSpec, seed: int) -> tuple[Policy, torch.Tensor]:
    torch.manual_seed(seed)
    policy = Policy(spec, learning_rate=LR, preloaded=load_base(spec.base_model), seed=seed)
    return policy, torch.get_rng_state()


def test_the_next_lora_job_starts_bit_for_bit_as_a_fresh_process(model_dir, tmp_path) -> None:
    spec = ModelSpec(base_model=str(model_dir), lora=LoraConfig(rank=4, alpha=8.0))
    want, want_rng = fresh(spec, seed=11)
    want_start = state(want)
    train_a_step(want)
    want_stepped = state(want)
    want.save_checkpoint(tmp_path / "fresh")

    preload = Preload(load_base(str(model_dir)))
    last = job_on(preload, spec, seed=3)  # the tenant's last job: trains, ends well
    assert not last.reused
    train_a_step(last)
    assert preload.take_back(), "a LoRA job's wrapped model is kept"
    wrapped = last.model
    del last

    again = job_on(preload, spec, seed=11)
    assert again.reused and again.model is wrapped, "not the kept model"
    assert torch.equal(torch.get_rng_state(), want_rng), "torch's random state differs"
    assert_same(state(again), want_start)
    # The base weights are the files' still (a LoRA job freezes them), and the next step
    # (forward, backward, a fresh AdamW) gives the same numbers.
    base = {n: p for n, p in again.model.named_parameters() if not p.requires_grad}
    fresh_base = {n: p for n, p in want.model.named_parameters() if not p.requires_grad}
    assert_same(base, fresh_base)
    train_a_step(again)
    assert_same(state(again), want_stepped)
    again.save_checkpoint(tmp_path / "again")
    config = "adapter_config.json"
    assert json.loads((tmp_path / "again" / config).read_text()) == json.loads(
        (tmp_path / "fresh" / config).read_text()
    )


def test_another_wrap_or_a_full_fine_tune_reads_the_base_from_its_files(model_dir) -> None:
    lora = ModelSpec(base_model=str(model_dir), lora=LoraConfig(rank=4, alpha=8.0))
    preload = Preload(load_base(str(model_dir)))
    train_a_step(job_on(preload, lora, seed=3))
    assert preload.take_back()

    other_rank = lora.model_copy(update={"lora": LoraConfig(rank=2, alpha=8.0)})
    got = job_on(preload, other_rank, seed=5)
    assert not got.reused
    want, _ = fresh(other_rank, seed=5)
    assert_same(state(got), state(want))
    assert preload.take_back(), "the kept model is still there for the tenant's next job"

    full = lora.model_copy(update={"finetune": "full"})
    got = job_on(preload, full, seed=5)
    assert not got.reused
    want, _ = fresh(full, seed=5)
    assert_same(state(got), state(want))  # every weight: the files', not the wrapped model's


def test_a_model_with_role_adapters_is_not_reused(model_dir) -> None:
    spec = ModelSpec(base_model=str(model_dir))
    preload = Preload(load_base(str(model_dir)))
    job_on(preload, spec, seed=3).use_role_adapters(("a", "b"))
    assert preload.take_back()
    assert not job_on(preload, spec, seed=3).reused


def test_a_reused_rollout_serves_the_base_until_the_trainer_sends_version_0(model_dir) -> None:
    """The rollout keeps the wrapped model too; the next job's engine is new, its adapter made
    anew (the base's numbers exactly, as a fresh engine's), and takes the trainer's weights."""
    from opentinker.services.rollout.engines.engine import TransformersEngine
    from opentinker.services.rollout.engines.kept_engine import kept_engine_factory

    spec = ModelSpec(base_model=str(model_dir))
    preload = Preload(load_base(str(model_dir)))

    def cold(_: ModelSpec) -> TransformersEngine:
        raise AssertionError("read from the files")

    factory = kept_engine_factory(preload, cold, max_batch_size=8, device="cpu")
    first = factory(spec)
    trained, _ = fresh(spec, seed=3)
    train_a_step(trained)
    first.apply_weights(trained.trainable_state(), policy_version=1)
    ids = trained.probe_token_ids
    assert preload.take_back()
    second = factory(spec)
    assert second.model is first.model and second.policy_version == 0
    base = TransformersEngine.load(spec, device="cpu")  # a fresh process's engine
    assert second.logprobs_of(ids) == base.logprobs_of(ids)
    second.apply_weights(trained.trainable_state(), policy_version=1)
    assert second.logprobs_of(ids) == pytest.approx(trained.probe_logprobs(ids), abs=1e-5)


def test_a_saved_adapters_model_card_is_the_one_peft_renders(model_dir, tmp_path) -> None:
    """policy.save_checkpoint hands peft the blank card rendered once (model_card.py)."""
    policy, _ = fresh(ModelSpec(base_model=str(model_dir)), seed=1)
    policy.model.save_pretrained(tmp_path / "peft")  # peft renders its template itself
    policy.save_checkpoint(tmp_path / "ours")
    policy.save_checkpoint(tmp_path / "again")
    card = (tmp_path / "peft" / "README.md").read_text()
    assert "library_name: peft" in card
    assert (tmp_path / "ours" / "README.md").read_text() == card
    assert (tmp_path / "again" / "README.md").read_text() == card


def test_peft_made_again_gives_the_same_adapter_as_drawn_in_place(model_dir) -> None:
    """reset_adapter's other way (peft's delete_adapter/add_adapter: adapters that are not
    float32 on the CPU) is bit for bit a fresh wrap too."""
    from opentinker.services.modeling.kept_wrap import reset_adapter

    spec = ModelSpec(base_model=str(model_dir))
    want, want_rng = fresh(spec, seed=11)
    last, _ = fresh(spec, seed=3)
    train_a_step(last)
    reset_adapter(last.model, spec, seed=11, in_place=False)
    assert torch.equal(torch.get_rng_state(), want_rng)
    got = {n: p.detach() for n, p in last.model.named_parameters() if p.requires_grad}
    assert_same(got, state(want))
