"""The RL update on the real tiny model: gradient accumulation is exact, several epochs make
the clip bite, the reference policy and the critic behave, the LR schedule is applied."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.trainer import checkpoints
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.rl.batch import Episode
from opentinker.services.trainer.rl.batch_work import UpdateConfig, prepare
from opentinker.services.trainer.rl.critic import Critic
from opentinker.services.trainer.rl.reference import ReferencePolicy
from opentinker.services.trainer.rl.training import backward_minibatch, rl_update
from opentinker.spec import LoraConfig, ModelSpec, RlConfig

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


def full_policy(model_dir: Path, lr: float = 1e-3) -> Policy:
    return Policy(ModelSpec(base_model=str(model_dir), finetune="full"), learning_rate=lr)


def lora_policy(model_dir: Path, lr: float = 1e-2) -> Policy:
    spec = ModelSpec(base_model=str(model_dir), finetune="lora", lora=LoraConfig(rank=4))
    return Policy(spec, learning_rate=lr, seed=0)


def varied_episodes(policy: Policy) -> list[Episode]:
    """Three groups of two, completions of 1..4 tokens, one rewarded answer per group."""
    prompt = policy.probe_token_ids[:10]
    completions = [[65], [66, 67, 68], [69, 70], [71], [72, 73, 74, 75], [76, 77]]
    out = []
    for i, completion in enumerate(completions):
        ids = prompt + completion
        old = policy.probe_logprobs(ids)[len(prompt) - 1 :]
        reward = 1.0 if i % 2 == 0 else 0.0
        out.append(Episode(i // 2, 0, ids, len(prompt), old, [1] * len(completion), reward, False))
    return out


def gradients(policy: Policy) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("normalization", ["sequence", "token", "constant"])
def test_accumulated_gradients_equal_the_one_shot_gradient(
    tiny_model_dir: Path, normalization: str
) -> None:
    policy = full_policy(tiny_model_dir)
    episodes = varied_episodes(policy)
    rows = list(range(len(episodes)))
    grads = []
    # one pass; 14 tokens: the longest sequence (14) alone, or 1 x 13 ...; cut where padding
    # would pass a quarter of a pass; every length alone
    splits = ((0, 1.0), (14, 1.0), (0, 0.25), (0, 0.0))
    for budget, max_padding in splits:
        config = UpdateConfig(
            normalization=normalization,  # type: ignore[arg-type]
            max_completion_tokens=4,
            micro_batch_tokens=budget,
            max_padding=max_padding,
        )
        work = prepare(policy, episodes, config, reference=None, critic=None)
        backward_minibatch(policy, work, rows, rows, config)
        grads.append(gradients(policy))
        policy.optimizer.zero_grad(set_to_none=True)
    one_shot = grads[0]
    assert one_shot
    for split, accumulated in zip(splits[1:], grads[1:], strict=True):
        assert one_shot.keys() == accumulated.keys()
        worst = max(float((one_shot[n] - accumulated[n]).abs().max()) for n in one_shot)
        assert worst < 1e-6, (split, worst)


def test_the_update_and_the_reference_run_one_pass_per_like_length_set(
    tiny_model_dir: Path,
) -> None:
    """The padding share reaches every forward of an update (the policy's and the frozen
    reference's): at 0 each distinct length (11..14 tokens) gets its own pass, at 1 the batch
    is one pass; RlConfig's max_padding_fraction is what the trainer's config carries."""
    policy = full_policy(tiny_model_dir)
    reference = ReferencePolicy.from_policy(policy)
    assert reference.frozen is not None
    episodes = varied_episodes(policy)
    passes = {"policy": 0, "reference": 0}
    for name, model in (("policy", policy.model), ("reference", reference.frozen)):
        model.get_decoder().register_forward_pre_hook(
            lambda *_, name=name: passes.__setitem__(name, passes[name] + 1)
        )
    # A set of rows sharing a prompt runs as two body passes (the prompt, then the rows), a
    # lone row as one: at 0, lengths 14 and 13 (one row each), 12 and 11 (two each): 6
    # The step reports padding's share: none when every length is alone; in one pass, rows of
    # 11..14 tokens padded to 14: 6 x 14 = 84 computed, 73 real.
    for max_padding, want, padding in ((0.0, 6, 0.0), (1.0, 2, 11 / 84)):
        passes.update(policy=0, reference=0)
        config = UpdateConfig(kl_coef=0.1, max_padding=max_padding)
        stats = rl_update(policy, episodes, config, reference=reference)
        assert passes == {"policy": want, "reference": want}, (max_padding, passes)
        assert stats.padding_share == pytest.approx(padding)
    rl = RlConfig(env_name="letter", max_padding_fraction=0.1)
    assert UpdateConfig.from_rl(rl).max_padding == 0.1


def test_several_epochs_and_minibatches_make_the_clip_matter(tiny_model_dir: Path) -> None:
    policy = full_policy(tiny_model_dir, lr=3e-3)
    episodes = varied_episodes(policy)
    one = rl_update(policy, episodes, UpdateConfig())
    assert one.optimizer_steps == 1 and one.clip_fraction == 0.0  # on-policy: ratio 1
    policy = full_policy(tiny_model_dir, lr=3e-3)
    many = rl_update(policy, episodes, UpdateConfig(ppo_epochs=4, minibatch_size=2))
    # 4 epochs x 3 minibatches of 2 sequences = 12 optimizer steps
    assert many.optimizer_steps == 12
    assert many.clip_fraction > 0.0 and many.ratio_mean != pytest.approx(1.0)


def test_lora_reference_is_the_base_with_the_adapter_disabled(tiny_model_dir: Path) -> None:
    policy = lora_policy(tiny_model_dir)
    reference = ReferencePolicy.from_policy(policy)
    assert reference.frozen is None  # no second copy of the weights
    episodes = varied_episodes(policy)
    config = UpdateConfig(kl_coef=0.1)
    first = rl_update(policy, episodes, config, reference=reference)
    assert first.kl == pytest.approx(0.0, abs=1e-6)  # lora_B starts at 0: policy == base
    second = rl_update(policy, episodes, config, reference=reference)
    assert second.kl > 1e-6  # the adapter moved the policy away from the base
    # the reference still answers the base model's logprobs
    work = prepare(policy, episodes, config, reference=reference, critic=None)
    base = lora_policy(tiny_model_dir)
    expected = torch.tensor(base.probe_logprobs(episodes[0].token_ids))
    n = len(expected)
    assert work.ref_B_T is not None
    assert torch.allclose(work.ref_B_T[0, :n] * work.full.loss_mask_B_T[0, :n],
                          expected * work.full.loss_mask_B_T[0, :n], atol=1e-5)  # fmt: skip


def test_full_finetune_reference_is_a_frozen_copy(tiny_model_dir: Path) -> None:
    policy = full_policy(tiny_model_dir)
    reference = ReferencePolicy.from_policy(policy)
    assert reference.frozen is not None
    assert not any(p.requires_grad for p in reference.frozen.parameters())
    episodes = varied_episodes(policy)
    rl_update(policy, episodes, UpdateConfig(), reference=reference)
    stats = rl_update(policy, episodes, UpdateConfig(kl_coef=0.1), reference=reference)
    assert stats.kl > 1e-6


def test_critic_trains_and_survives_a_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    policy = lora_policy(tiny_model_dir)
    hidden = policy.model.config.hidden_size
    critic = Critic(hidden, learning_rate=1e-2, device=policy.device)
    episodes = varied_episodes(policy)
    config = UpdateConfig(loss="ppo", ppo_epochs=2, gamma=1.0, gae_lambda=0.95)
    first = rl_update(policy, episodes, config, critic=critic)
    assert first.value_loss > 0 and first.optimizer_steps == 2
    assert first.explained_variance == pytest.approx(0.0, abs=1e-6)  # V = 0 at start
    assert critic.head.weight.abs().sum() > 0  # the head moved
    state = checkpoints.TrainerState(job_id="j", step=1, policy_version=1, data_cursor=1,
                                     rewards=[0.5])  # fmt: skip
    path = checkpoints.save(policy, state, tmp_path, keep=1, critic=critic)
    restored = Critic(hidden, learning_rate=1e-2, device=policy.device)
    checkpoints.load(lora_policy(tiny_model_dir), path, critic=restored)
    assert torch.equal(restored.head.weight, critic.head.weight)
    assert (
        restored.optimizer.state_dict()["state"].keys()
        == critic.optimizer.state_dict()["state"].keys()
    )


def test_entropy_bonus_alone_raises_the_entropy(tiny_model_dir: Path) -> None:
    policy = full_policy(tiny_model_dir, lr=1e-4)  # a small step: the first-order effect
    same = [  # every reward equal: advantage 0, only the entropy term has a gradient
        Episode(0, 0, e.token_ids, e.prompt_length, e.logprobs, e.loss_mask, 1.0, False)
        for e in varied_episodes(policy)
    ]
    config = UpdateConfig(entropy_coef=1.0)
    before = rl_update(policy, same, config)
    assert before.optimizer_steps == 1 and before.grad_norm > 0
    after = rl_update(policy, same, config)
    assert after.entropy > before.entropy  # measured before each step


def test_kl_in_the_reward_lowers_the_advantage_of_sequences_far_from_the_reference(
    tiny_model_dir: Path,
) -> None:
    policy = lora_policy(tiny_model_dir)
    reference = ReferencePolicy.from_policy(policy)
    rl_update(policy, varied_episodes(policy), UpdateConfig(), reference=reference)
    episodes = varied_episodes(policy)  # sampling logprobs of the moved policy
    plain = prepare(policy, episodes, UpdateConfig(kl_coef=0.0), reference=reference, critic=None)
    penalized = prepare(
        policy, episodes, UpdateConfig(kl_coef=5.0, kl_in_reward=True, loss="reinforce"),
        reference=reference, critic=None,
    )  # fmt: skip
    assert plain.ref_B_T is not None and penalized.ref_B_T is not None
    # reinforce: A_b = r_b - coef * KL_b - mean(...): the advantages moved, and they still sum
    # to 0 over the batch (one value per sequence, on each of its tokens)
    firsts = [
        float(penalized.advantages_B_T[b, e.prompt_length - 1]) for b, e in enumerate(episodes)
    ]
    assert sum(firsts) == pytest.approx(0.0, abs=1e-5)
    rewards = [e.reward - sum(e.reward for e in episodes) / len(episodes) for e in episodes]
    assert max(abs(a - r) for a, r in zip(firsts, rewards, strict=True)) > 1e-4


def test_a_bf16_full_fine_tune_runs_ppo_with_a_critic_and_a_reference(tiny_model_dir: Path) -> None:
    """The dtypes of a GPU job (bf16 policy and reference, float32 masters and critic), on CPU:
    a PPO update with KL and a value head runs, every weight stays bf16, and the policy moves."""
    spec = ModelSpec(base_model=str(tiny_model_dir), finetune="full")
    policy = Policy(spec, learning_rate=1e-5, dtype=torch.bfloat16)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    reference = ReferencePolicy.from_policy(policy)
    critic = Critic(policy.model.config.hidden_size, learning_rate=1e-2, device=policy.device)
    config = UpdateConfig(loss="ppo", ppo_epochs=2, gamma=1.0, gae_lambda=0.95, kl_coef=0.1)
    stats = rl_update(policy, varied_episodes(policy), config, reference=reference, critic=critic)
    assert stats.value_loss > 0 and stats.optimizer_steps == 2 and stats.grad_norm > 0
    assert {p.dtype for p in policy.model.parameters()} == {torch.bfloat16}
    assert critic.head.weight.dtype == torch.float32 and critic.head.weight.abs().sum() > 0
    moved = [n for n, p in policy.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) > len(before) / 2, moved  # 2 steps of 1e-5: kept by the masters


def shifted(episodes: list[Episode], shift: float) -> list[Episode]:
    """The episodes as a rollout whose kernels put every sampled token ``shift`` lower than
    the trainer does (bf16 vLLM against the trainer, exaggerated)."""
    return [dataclasses.replace(e, logprobs=[lp - shift for lp in e.logprobs]) for e in episodes]


def update_gradients(model_dir: Path, episodes_of, config: UpdateConfig):
    policy = full_policy(model_dir)
    episodes = episodes_of(policy)
    work = prepare(policy, episodes, config, reference=None, critic=None)
    backward_minibatch(policy, work, list(range(len(episodes))), list(range(len(episodes))), config)
    return gradients(policy), work


def test_trainer_old_logprobs_start_the_ratio_at_one_and_weigh_the_mismatch(
    tiny_model_dir: Path,
) -> None:
    """A rollout 0.5 below the trainer on every token: against the rollout's logprobs the
    ratio starts at e^0.5 and the clip takes every advantaged token; against the trainer's own
    it starts at 1, and truncated importance sampling weighs each token by e^0.5 (under the
    cap of 2), then by 2 once the gap passes ln 2."""
    rollout = full_policy(tiny_model_dir, lr=1e-4)
    stats = rl_update(rollout, shifted(varied_episodes(rollout), 0.5), UpdateConfig())
    assert stats.clip_fraction > 0.4 and stats.ratio_mean == pytest.approx(math.exp(0.5), 1e-3)
    trainer = full_policy(tiny_model_dir, lr=1e-4)
    config = UpdateConfig(old_logprobs="trainer")
    stats = rl_update(trainer, shifted(varied_episodes(trainer), 0.5), config)
    assert stats.clip_fraction == 0.0 and stats.ratio_mean == pytest.approx(1.0, abs=1e-6)
    assert stats.logprob_gap == pytest.approx(0.5, abs=1e-4)  # still the trainer-rollout gap

    plain, _ = update_gradients(
        tiny_model_dir, lambda p: shifted(varied_episodes(p), 0.5), replace(config, tis_cap=0.0)
    )
    for shift, weight in ((0.5, math.exp(0.5)), (1.0, 2.0)):
        weighted, work = update_gradients(
            tiny_model_dir, lambda p, s=shift: shifted(varied_episodes(p), s), config
        )
        assert work.old_B_T is None  # one optimizer step: its own forward pass gives them
        for name, grad in plain.items():
            torch.testing.assert_close(weighted[name], weight * grad, rtol=1e-3, atol=1e-6)


def test_several_steps_take_the_trainer_old_logprobs_from_before_the_first(
    tiny_model_dir: Path,
) -> None:
    """Two epochs: the second pass's old policy is the one before the update (prepare runs
    it once), so its ratio moves away from 1 and the clip can act, as in PPO."""
    policy = full_policy(tiny_model_dir, lr=1e-2)
    episodes = shifted(varied_episodes(policy), 0.3)
    config = UpdateConfig(old_logprobs="trainer", ppo_epochs=2)
    work = prepare(policy, episodes, config, reference=None, critic=None)
    assert work.old_B_T is not None
    on = work.full.loss_mask_B_T > 0
    gap = (work.old_B_T - work.full.old_logprobs_B_T)[on]
    assert torch.allclose(gap, torch.full_like(gap, 0.3), atol=1e-4)  # the trainer's, before
    stats = rl_update(policy, episodes, config)
    assert stats.optimizer_steps == 2 and stats.clip_fraction > 0


def test_auto_old_logprobs_are_the_trainers_when_the_policy_is_not_float32() -> None:
    rl = RlConfig(env_name="letter")
    assert UpdateConfig.from_rl(rl).old_logprobs == "rollout"
    assert UpdateConfig.from_rl(rl, policy_dtype=torch.bfloat16).old_logprobs == "trainer"
    forced = RlConfig(env_name="letter", old_logprobs="rollout", tis_cap=0.0)
    assert UpdateConfig.from_rl(forced, policy_dtype=torch.bfloat16).old_logprobs == "rollout"
    assert UpdateConfig.from_rl(forced).tis_cap == 0.0
