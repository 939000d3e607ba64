"""Each prompt of a GRPO group run once in training (services/trainer/model/shared_prompts.py):
the same logprobs, entropies and gradients as the plain forward, and the same update."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.trainer.model import forward
from opentinker.services.trainer.model.forward import policy_forward
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.model.shared_prompts import prompt_groups
from opentinker.services.trainer.rl import batch_work, training
from opentinker.services.trainer.rl.batch import Episode, collate
from opentinker.services.trainer.rl.batch_work import UpdateConfig
from opentinker.spec import LoraConfig, ModelSpec

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


def spec(model_dir: Path, finetune: str, *, checkpointing: bool = False) -> ModelSpec:
    common = {"base_model": str(model_dir), "gradient_checkpointing": checkpointing}
    if finetune == "lora":
        return ModelSpec(**common, finetune="lora", lora=LoraConfig(rank=4))
    return ModelSpec(**common, finetune="full")


def grouped_episodes() -> list[Episode]:
    """Three prompts of 7, 12 and 4 tokens (the first two have 3 samples, the last one), rows
    interleaved, completions of 1-5 tokens, some with env tokens (loss mask 0) inside."""
    prompts = [list(range(40, 47)), list(range(100, 112)), [7, 8, 9, 10]]
    rows = [(0, [65]), (1, [66, 67, 68]), (0, [69, 70, 71, 72, 73]), (2, [74, 75]),
            (1, [76]), (0, [77, 78]), (1, [79, 80, 81, 82])]  # fmt: skip
    episodes = []
    for i, (group, completion) in enumerate(rows):
        mask = [0 if k == 1 and len(completion) > 2 else 1 for k in range(len(completion))]
        episodes.append(
            Episode(
                group_index=group,
                policy_version=0,
                token_ids=prompts[group] + completion,
                prompt_length=len(prompts[group]),
                logprobs=[-1.0 - 0.1 * k for k in range(len(completion))],
                loss_mask=mask,
                reward=float(i % 2),
                env_error=False,
            )
        )
    return episodes


def test_prompt_groups_name_each_distinct_prompt_once() -> None:
    episodes = grouped_episodes()
    groups = prompt_groups(episodes)
    assert groups is not None
    assert groups.distinct_rows == (0, 1, 3)
    assert groups.slot_of_row == (0, 1, 0, 2, 1, 0, 1)
    assert groups.prompt_lengths == (7, 12, 7, 4, 12, 7, 12)
    assert prompt_groups([episodes[0], episodes[1], episodes[3]]) is None  # nothing shared
    short = [Episode(0, 0, [5, 6], 1, [-1.0], [1], 0.0, False)] * 2
    assert prompt_groups(short) is None  # a 1-token prompt has nothing before its last token


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "checkpointed"])
@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_shared_prompts_give_the_plain_forwards_logprobs_and_gradients(
    model_dir: Path, finetune: str, checkpointing: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also under gradient checkpointing, whose backward recomputes every layer with the
    prompts' caches (a cache that appended would be appended to again: wrong shapes)."""
    policy = Policy(spec(model_dir, finetune, checkpointing=checkpointing), learning_rate=1e-3)
    assert policy.model.is_gradient_checkpointing == checkpointing
    recomputed = []
    layer = policy.model.get_decoder().layers[0]
    if checkpointing:  # count the layer's recomputations in the backward passes
        real = layer._gradient_checkpointing_func
        monkeypatch.setattr(
            layer, "_gradient_checkpointing_func", lambda f, *a, **k: real(
                lambda *x, **y: recomputed.append(torch.is_grad_enabled()) or f(*x, **y), *a, **k
            ),
        )  # fmt: skip
    episodes = grouped_episodes()
    batch = collate(episodes, policy.pad_id)
    mask_B_T = batch.loss_mask_B_T
    figures = {}
    for name, groups in (("plain", None), ("shared", prompt_groups(episodes))):
        policy.model.zero_grad()
        out = policy_forward(policy, batch, temperature=0.7, groups=groups)
        # A loss reading logprobs and entropies on trained tokens, unequal weights per token.
        weights_B_T = mask_B_T * torch.linspace(0.5, 1.5, mask_B_T.numel()).view_as(mask_B_T)
        ((out.logprobs_B_T + 0.1 * out.entropy_B_T) * weights_B_T).sum().backward()
        grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.requires_grad}
        figures[name] = (out.logprobs_B_T.detach(), out.entropy_B_T.detach(), grads)
    plain_lp, plain_ent, plain_grads = figures["plain"]
    shared_lp, shared_ent, shared_grads = figures["shared"]
    for b, ep in enumerate(episodes):
        computed = slice(ep.prompt_length - 1, len(ep.token_ids) - 1)
        torch.testing.assert_close(shared_lp[b, computed], plain_lp[b, computed])
        torch.testing.assert_close(shared_ent[b, computed], plain_ent[b, computed])
        assert not shared_lp[b, : ep.prompt_length - 1].any()  # not computed: 0
    assert all(g.abs().max() > 0 for n, g in plain_grads.items() if "lora_A" not in n)
    # checkpointed: the plain pass runs the layer once, the shared two (prompts, rows), and
    # each backward runs it again
    assert len(recomputed) == (6 if checkpointing else 0)
    for name, grad in plain_grads.items():  # (LoRA's A gets no gradient while B is 0)
        scale = max(float(grad.abs().max()), 1e-12)
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5 * scale, rtol=1e-4)


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_shared_prompts_run_the_head_only_at_the_loss_positions(
    model_dir: Path, finetune: str
) -> None:
    """With the loss mask as the wanted positions, the shared pass computes the head on the
    trained tokens only (not on the env tokens inside completions, nor on each row's last
    prompt token), with the plain pass's values there and its gradients."""
    policy = Policy(spec(model_dir, finetune), learning_rate=1e-3)
    episodes = grouped_episodes()
    batch = collate(episodes, policy.pad_id)
    wanted_B_T = batch.loss_mask_B_T > 0
    head = policy.model.get_output_embeddings()
    figures = {}
    for name, groups, wanted in (("plain", None, None),
                                 ("shared", prompt_groups(episodes), wanted_B_T)):  # fmt: skip
        seen: list[int] = []
        hook = head.register_forward_hook(lambda _m, a, _o, seen=seen: seen.append(a[0].shape[0]))
        policy.model.zero_grad()
        out = policy_forward(policy, batch, temperature=0.7, groups=groups, wanted_B_T=wanted)
        ((out.logprobs_B_T + 0.1 * out.entropy_B_T) * batch.loss_mask_B_T).sum().backward()
        hook.remove()
        grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.requires_grad}
        figures[name] = (out.logprobs_B_T.detach(), out.entropy_B_T.detach(), grads, sum(seen))
    plain_lp, plain_ent, plain_grads, plain_rows = figures["plain"]
    lp, ent, grads, rows = figures["shared"]
    torch.testing.assert_close(lp[wanted_B_T], plain_lp[wanted_B_T])
    torch.testing.assert_close(ent[wanted_B_T], plain_ent[wanted_B_T])
    assert not lp[~wanted_B_T].any() and not ent[~wanted_B_T].any()
    for name, grad in plain_grads.items():
        scale = max(float(grad.abs().max()), 1e-12)
        torch.testing.assert_close(grads[name], grad, atol=1e-5 * scale, rtol=1e-4)
    trained = int(wanted_B_T.sum())  # 18 completion tokens, 3 of them env tokens
    assert trained == 15 and rows == 2 * trained  # forward + the backward's recomputation
    assert plain_rows == 2 * batch.loss_mask_B_T.numel()


def test_an_update_with_shared_prompts_moves_the_weights_as_the_plain_one(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rl_update end to end (two micro-batches, two minibatches): the same weights after."""
    policy = Policy(spec(model_dir, "full"), learning_rate=1e-3)
    twin = copy.deepcopy(policy)
    start = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    config = UpdateConfig(
        clip_epsilon=0.2, temperature=1.0, minibatch_size=4, micro_batch_tokens=40
    )
    calls = []
    real = forward.shared_prompt_logprobs
    monkeypatch.setattr(
        forward, "shared_prompt_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    shared_stats = training.rl_update(policy, grouped_episodes(), config)
    assert calls  # some micro-batch did share its prompts
    monkeypatch.setattr(training, "prompt_groups", lambda episodes: None)  # the plain forward
    plain_stats = training.rl_update(twin, grouped_episodes(), config)
    assert shared_stats.optimizer_steps == plain_stats.optimizer_steps == 2
    assert shared_stats.loss == pytest.approx(plain_stats.loss, rel=1e-4, abs=1e-6)
    # Adam's first steps move an element by about lr * sign(g): where g is near 0 (~1e-8),
    # the 1e-9 rounding of another summation order moves it by up to a few % of lr. A wrong
    # gradient would move most elements differently by ~lr.
    lr = 1e-3
    elements = off = 0
    for (name, after), (_, plain_after) in zip(
        policy.model.named_parameters(), twin.model.named_parameters(), strict=True
    ):
        gap = (after - plain_after).detach().abs()
        assert float(gap.max()) < 0.1 * lr, name
        off += int((gap > 1e-6).sum())
        elements += gap.numel()
        assert not torch.equal(after, start[name]), f"{name} did not move"
    assert off < 1e-3 * elements


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_the_reference_policy_shares_prompts_too(model_dir: Path, finetune: str) -> None:
    """The KL term's reference (a frozen copy, or LoRA's base with the adapter off): the same
    logprobs from the last prompt token on, after the policy has moved away from it."""
    from opentinker.services.trainer.rl.reference import ReferencePolicy

    policy = Policy(spec(model_dir, finetune), learning_rate=1e-2)
    reference = ReferencePolicy.from_policy(policy)
    episodes = grouped_episodes()
    training.rl_update(policy, episodes, UpdateConfig(clip_epsilon=0.2, temperature=1.0))
    batch = collate(episodes, policy.pad_id)
    plain = reference.logprobs(batch, temperature=0.8)
    shared = reference.logprobs(batch, temperature=0.8, groups=prompt_groups(episodes))
    moved = policy_forward(policy, batch, temperature=0.8).logprobs_B_T.detach()
    for b, ep in enumerate(episodes):
        computed = slice(ep.prompt_length - 1, len(ep.token_ids) - 1)
        torch.testing.assert_close(shared[b, computed], plain[b, computed])
        assert not shared[b, : ep.prompt_length - 1].any()
    assert not torch.allclose(moved, plain, atol=1e-4)  # the reference is not the policy


def test_a_critic_reads_the_same_hidden_states_and_ppo_moves_the_weights_as_the_plain_one(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PPO's value head reads the last hidden state at each completion position: the shared
    forward gives the plain one's there, and a whole PPO update (values before it, GAE, value
    loss) moves the policy and the critic as the plain path does."""
    from opentinker.services.trainer.rl.batch_work import prepare
    from opentinker.services.trainer.rl.critic import Critic

    policy = Policy(spec(model_dir, "full"), learning_rate=1e-3)
    episodes = grouped_episodes()
    batch = collate(episodes, policy.pad_id)
    groups = prompt_groups(episodes)
    plain = policy_forward(policy, batch, temperature=1.0, hidden=True).hidden_B_T_H
    shared = policy_forward(policy, batch, temperature=1.0, hidden=True, groups=groups)
    assert plain is not None and shared.hidden_B_T_H is not None
    for b, ep in enumerate(episodes):
        computed = slice(ep.prompt_length - 1, len(ep.token_ids) - 1)
        torch.testing.assert_close(shared.hidden_B_T_H[b, computed], plain[b, computed])
        assert not shared.hidden_B_T_H[b, : ep.prompt_length - 1].any()

    config = UpdateConfig(loss="ppo", ppo_epochs=2, minibatch_size=4, gamma=1.0, gae_lambda=0.95)
    twin, sides = copy.deepcopy(policy), {}
    shared_calls = []
    for module, name in ((batch_work, "shared_prompt_hidden"), (forward, "shared_prompt_logprobs")):
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _real=real, _name=name, **k: shared_calls.append(_name)
            or _real(*a, **k),
        )  # fmt: skip
    for name, model in (("shared", policy), ("plain", twin)):
        critic = Critic(policy.model.config.hidden_size, learning_rate=1e-2, device=model.device)
        torch.nn.init.normal_(
            critic.head.weight, std=0.5, generator=torch.Generator().manual_seed(1)
        )
        if name == "plain":  # every forward (values, update) on the plain path
            monkeypatch.setattr(training, "prompt_groups", lambda episodes: None)
            monkeypatch.setattr(batch_work, "prompt_groups", lambda episodes: None)
        work = prepare(model, grouped_episodes(), config, reference=None, critic=critic)
        stats = training.rl_update(model, grouped_episodes(), config, critic=critic)
        sides[name] = (work, stats, critic.head.weight.detach().clone())
        if name == "shared":  # the values and the update's forwards did share the prompts
            assert {"shared_prompt_hidden", "shared_prompt_logprobs"} <= set(shared_calls)
            shared_calls.clear()
    assert not shared_calls  # the plain side did not
    (work, stats, head), (plain_work, plain_stats, plain_head) = sides["shared"], sides["plain"]
    assert work.old_values_B_T is not None and plain_work.old_values_B_T is not None
    assert work.old_values_B_T.abs().max() > 0  # a non-zero head: the values mean something
    torch.testing.assert_close(work.old_values_B_T, plain_work.old_values_B_T)
    assert stats.value_loss == pytest.approx(plain_stats.value_loss, rel=1e-4)
    torch.testing.assert_close(head, plain_head, atol=1e-6, rtol=1e-4)
    for (name, after), (_, plain_after) in zip(
        policy.model.named_parameters(), twin.model.named_parameters(), strict=True
    ):
        assert float((after - plain_after).detach().abs().max()) < 0.1 * 1e-3, name  # as above


def test_a_model_with_sliding_window_layers_keeps_the_plain_forward() -> None:
    """The shared caches keep every key; a sliding-window layer must not see past its window,
    so such a model is not given them."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from opentinker.services.modeling.attention import has_full_attention_only

    sizes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip
    assert has_full_attention_only(Qwen2ForCausalLM(Qwen2Config(**sizes)))
    windowed = Qwen2Config(**sizes, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert not has_full_attention_only(Qwen2ForCausalLM(windowed))
