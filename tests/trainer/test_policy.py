"""Policy: LoRA/full parameter sets, logprobs of padded batches, a step, checkpoints that reload."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.trainer.model.policy import PROBE_LENGTH, Policy
from opentinker.services.trainer.rl.batch import Episode, collate
from opentinker.services.trainer.rl.training import grpo_update
from opentinker.spec import LoraConfig, ModelSpec

pytestmark = pytest.mark.integration  # real tiny model on disk, loaded with from_pretrained


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


def lora_spec(model_dir: Path, dropout: float = 0.0) -> ModelSpec:
    return ModelSpec(
        base_model=str(model_dir), finetune="lora", lora=LoraConfig(rank=4, dropout=dropout)
    )


def episodes_with_signal(policy: Policy) -> list[Episode]:
    """Two groups of two: in each, one sampled answer is rewarded and one is not."""
    prompt = policy.probe_token_ids[:12]
    out = []
    for group, completions in enumerate([([65], [66, 67]), ([68, 69], [70])]):
        for reward, completion in zip((1.0, 0.0), completions, strict=True):
            ids = prompt + completion
            old = policy.probe_logprobs(ids)[len(prompt) - 1 :]
            out.append(
                Episode(group, 0, ids, len(prompt), old, [1] * len(completion), reward, False)
            )
    return out


def test_lora_trains_only_the_adapter(tiny_model_dir: Path) -> None:
    policy = Policy(lora_spec(tiny_model_dir), learning_rate=1e-3)
    state = policy.trainable_state()
    # 2 layers x 4 target modules (q,k,v,o) x (lora_A, lora_B)
    assert len(state) == 2 * 4 * 2
    assert all(".lora_A." in name or ".lora_B." in name for name in state)
    frozen = [n for n, p in policy.model.named_parameters() if not p.requires_grad]
    assert frozen and not any("lora_" in n for n in frozen)
    assert policy.num_trainable_parameters() == sum(t.numel() for t in state.values())
    # the rollout wraps the same base with the same config: the names are the same
    other = Policy(lora_spec(tiny_model_dir), learning_rate=1e-3)
    assert list(other.trainable_state()) == list(state)


def test_full_finetune_trains_every_parameter(tiny_model_dir: Path) -> None:
    policy = Policy(ModelSpec(base_model=str(tiny_model_dir), finetune="full"), learning_rate=1e-3)
    assert all(p.requires_grad for p in policy.model.parameters())
    assert "model.embed_tokens.weight" in policy.trainable_state()
    assert not policy.is_lora


def test_probe_ids_come_from_the_chat_template(tiny_model_dir: Path) -> None:
    policy = Policy(lora_spec(tiny_model_dir), learning_rate=1e-3)
    ids = policy.probe_token_ids
    assert len(ids) == PROBE_LENGTH
    assert policy.tokenizer.decode(ids).startswith("<|im_start|>system\n")
    assert len(policy.probe_logprobs(ids)) == PROBE_LENGTH - 1


def test_padded_batch_logprobs_equal_single_sequence_logprobs(tiny_model_dir: Path) -> None:
    # dropout 0.3 on: token_logprobs runs in train mode, so compare in eval mode
    policy = Policy(lora_spec(tiny_model_dir, dropout=0.0), learning_rate=1e-3)
    episodes = episodes_with_signal(policy)  # lengths 13, 14, 14, 13: padding on two rows
    batch = collate(episodes, policy.pad_id)
    logprobs_B_T, entropy_B_T = policy.token_logprobs_and_entropy(batch)
    for b, ep in enumerate(episodes):
        alone = torch.tensor(policy.probe_logprobs(ep.token_ids))
        assert torch.allclose(logprobs_B_T[b, : len(alone)], alone, atol=1e-5)
        # the masked positions carry exactly the rollout's (here: same weights) logprobs
        mask = batch.loss_mask_B_T[b] > 0
        assert torch.allclose(logprobs_B_T[b][mask], batch.old_logprobs_B_T[b][mask], atol=1e-5)
    # entropy of a distribution over V tokens lies in (0, ln V]
    log_vocab = torch.log(torch.tensor(float(policy.model.config.vocab_size)))
    assert (entropy_B_T > 0).all() and (entropy_B_T <= log_vocab + 1e-4).all()


def test_a_step_changes_only_trainable_parameters(tiny_model_dir: Path) -> None:
    torch.manual_seed(0)
    policy = Policy(lora_spec(tiny_model_dir), learning_rate=1e-2)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    episodes = episodes_with_signal(policy)
    lp_before = policy.probe_logprobs(episodes[0].token_ids)[-1]  # rewarded answer 'A'
    stats = grpo_update(policy, episodes, clip_epsilon=0.2, temperature=1.0)
    after = dict(policy.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert changed and changed <= set(policy.trainable_state())
    assert any(".lora_B." in n for n in changed)  # B starts at zero and must move
    assert (
        stats.grad_norm > 0 and stats.logprob_gap < 1e-5 and stats.ratio_mean == pytest.approx(1.0)
    )
    # the rewarded completion became more likely
    assert policy.probe_logprobs(episodes[0].token_ids)[-1] > lp_before


def test_lora_checkpoint_reloads_with_peft_and_gives_the_same_logprobs(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    policy = Policy(lora_spec(tiny_model_dir), learning_rate=1e-2)
    grpo_update(policy, episodes_with_signal(policy), clip_epsilon=0.2, temperature=1.0)
    out = policy.save_checkpoint(tmp_path / "ckpt", trainer_state={"step": 1})
    assert out.is_absolute()
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    assert (out / "tokenizer.json").exists() and (out / "trainer_state.json").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, out).eval()
    ids = torch.tensor([policy.probe_token_ids])
    logits = reloaded(input_ids=ids).logits[0, :-1]
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    assert torch.allclose(
        lp, torch.tensor(policy.probe_logprobs(policy.probe_token_ids)), atol=1e-5
    )


def test_full_checkpoint_reloads_with_from_pretrained(tiny_model_dir: Path, tmp_path: Path) -> None:
    spec = ModelSpec(base_model=str(tiny_model_dir), finetune="full")
    policy = Policy(spec, learning_rate=1e-3)
    grpo_update(policy, episodes_with_signal(policy), clip_epsilon=0.2, temperature=1.0)
    out = policy.save_checkpoint(tmp_path / "ckpt")
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([policy.probe_token_ids])
    lp = torch.log_softmax(reloaded(input_ids=ids).logits[0, :-1], -1)
    lp = lp.gather(-1, ids[0, 1:, None]).squeeze(-1)
    expected = torch.tensor(policy.probe_logprobs(policy.probe_token_ids))
    assert torch.allclose(lp, expected, atol=1e-5)
    base = Policy(spec, learning_rate=1e-3)  # and the step really moved the weights
    assert not torch.allclose(torch.tensor(base.probe_logprobs(base.probe_token_ids)), expected)


def test_skipping_zero_advantage_groups_gives_the_full_batch_update(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group whose rewards are all equal has advantage 0 and contributes exactly 0 to the loss
    and gradient; grpo_update leaves it out of the forward pass and rescales the rest. After one
    step, parameters must equal those of the plain full-batch update.

    Both sides run the plain forward: the shared-prompt one (tested in test_shared_prompts.py)
    sums in another order, and Adam's first step (about lr * sign(g)) turns the 1e-9 rounding
    of a near-zero gradient element into a 1e-5 move, more than this test's 1e-6."""
    from opentinker.services.trainer.losses.policy_gradient import grpo_loss
    from opentinker.services.trainer.rl import training
    from opentinker.services.trainer.rl.training import episode_advantages

    monkeypatch.setattr(training, "prompt_groups", lambda episodes: None)

    spec = ModelSpec(base_model=str(tiny_model_dir), finetune="full")
    fast, full = Policy(spec, learning_rate=1e-3), Policy(spec, learning_rate=1e-3)
    signal = episodes_with_signal(fast)
    flat = [  # a third group, both rewards 1.0: advantage 0
        Episode(2, 0, e.token_ids, e.prompt_length, e.logprobs, e.loss_mask, 1.0, False)
        for e in signal[:2]
    ]
    episodes = signal + flat

    stats = grpo_update(fast, episodes, clip_epsilon=0.2, temperature=1.0)
    assert stats.sequences == 6 and stats.trained_tokens == 6  # only groups 0 and 1 trained

    batch = collate(episodes, full.pad_id)
    # the head on the positions the update computes (the trained groups'): the same sums
    advantages_B = episode_advantages(episodes)
    wanted_B_T = (batch.loss_mask_B_T > 0) & (advantages_B != 0)[:, None]
    new_B_T, _ = full.token_logprobs_and_entropy(batch, temperature=1.0, wanted_B_T=wanted_B_T)
    loss, _ = grpo_loss(new_B_T, batch.old_logprobs_B_T, advantages_B, batch.loss_mask_B_T, 0.2)
    assert loss.item() == pytest.approx(stats.loss, abs=1e-6)
    loss.backward()
    full.optimizer_step(1.0)
    for (name, a), (_, b) in zip(
        fast.model.named_parameters(), full.model.named_parameters(), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-6), name


def test_a_batch_without_signal_steps_on_zero_gradients(tiny_model_dir: Path) -> None:
    """No forward or backward, but AdamW's step still runs on zero gradients, as a plain loop's
    backward of a zero loss gives: nothing moves on a fresh optimizer, and after a step with
    signal the weights move by the optimizer's momentum exactly as in that plain loop."""
    spec = ModelSpec(base_model=str(tiny_model_dir), finetune="full")
    ours, plain = Policy(spec, learning_rate=1e-3), Policy(spec, learning_rate=1e-3)
    before = {n: p.detach().clone() for n, p in ours.model.named_parameters()}
    signal = episodes_with_signal(ours)
    same = [
        Episode(0, 0, e.token_ids, e.prompt_length, e.logprobs, e.loss_mask, 0.0, False)
        for e in signal
    ]

    def plain_zero_step(policy: Policy) -> None:  # a zero loss, its backward, the step
        sum(p.sum() * 0.0 for p in policy.trainable_parameters()).backward()
        policy.optimizer_step(1.0)

    fresh = grpo_update(ours, same, clip_epsilon=0.2, temperature=1.0)
    plain_zero_step(plain)
    assert fresh.trained_tokens == 0 and fresh.grad_norm == 0.0 and fresh.entropy > 0
    assert fresh.optimizer_steps == 1
    assert all(torch.equal(before[n], p) for n, p in ours.model.named_parameters())

    for policy in (ours, plain):  # the same step with signal on both
        grpo_update(policy, signal, clip_epsilon=0.2, temperature=1.0)
    after_signal = {n: p.detach().clone() for n, p in ours.model.named_parameters()}
    stats = grpo_update(ours, same, clip_epsilon=0.2, temperature=1.0)
    assert stats.optimizer_steps == 1 and stats.trained_tokens == 0
    plain_zero_step(plain)
    moved = [n for n, p in ours.model.named_parameters() if not torch.equal(after_signal[n], p)]
    assert moved, "the optimizer's momentum moved no weight"
    for (name, a), (_, b) in zip(
        ours.model.named_parameters(), plain.model.named_parameters(), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-7), name
