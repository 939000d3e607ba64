"""Micro-batches by token budget: every episode once, within budget, the whole batch's gradient."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.trainer.model.microbatch import (
    loss_tokens,
    micro_batches,
    split_by_token_budget,
)
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.rl.batch import Episode, collate
from opentinker.spec import ModelSpec


def episode(length: int, prompt: int = 2, first: int = 10) -> Episode:
    ids = [first + k for k in range(length)]
    n = length - prompt
    return Episode(0, 0, ids, prompt, [0.0] * n, [1] * n, 0.0, False)


def test_groups_fit_the_budget_longest_first() -> None:
    lengths = [5, 12, 3, 7, 7, 30, 4]
    episodes = [episode(n) for n in lengths]
    groups = split_by_token_budget(episodes, max_tokens=20)
    # longest first: 30 (alone, over budget), 12 (12+12 > 20), 7,7 (2*7=14; 3*7=21 > 20),
    # 5,4,3 (3*5=15 <= 20); each group's rows then in their given order
    assert [[lengths[i] for i in g] for g in groups] == [[30], [12], [7, 7], [5, 3, 4]]
    assert sorted(i for g in groups for i in g) == list(range(len(episodes)))
    assert split_by_token_budget(episodes, max_tokens=1000) == [[0, 1, 2, 3, 4, 5, 6]]
    assert split_by_token_budget([], max_tokens=10) == []
    with pytest.raises(ValueError, match="max_tokens"):
        split_by_token_budget(episodes, max_tokens=0)


def test_micro_batches_are_collated_on_their_own() -> None:
    episodes = [episode(n) for n in (5, 12, 3, 7)]
    parts = micro_batches(episodes, pad_id=0, max_tokens=14)
    # 12 alone (2*12 > 14), then 7,5 (2*7 = 14; in their given order), then 3
    assert [p.indices for p in parts] == [[1], [0, 3], [2]]
    assert [p.padded_tokens for p in parts] == [12, 14, 3]
    assert parts[1].batch.tokens_B_L.shape == (2, 7)
    # loss tokens: each episode trains on length - 2 tokens: 10 + 5 + 3 + 1
    assert loss_tokens(parts) == 19.0


@pytest.mark.integration
def test_accumulated_micro_batches_give_the_whole_batch_gradient(tmp_path: Path) -> None:
    model_dir = ensure_tiny_model(tmp_path / "tiny-qwen2")
    policy = Policy(ModelSpec(base_model=str(model_dir), finetune="full"), learning_rate=1e-3)
    episodes = [episode(n, prompt=3, first=20 + 7 * n) for n in (9, 14, 6, 11, 4)]
    weights = torch.tensor([1.0, -0.5, 2.0, 0.25, -1.0])  # per-episode, like advantages

    def token_mean_loss(batch, weights_B) -> torch.Tensor:
        logprobs_B_T, _ = policy.token_logprobs_and_entropy(batch)
        return -(logprobs_B_T * weights_B[:, None] * batch.loss_mask_B_T).sum()

    whole = collate(episodes, policy.pad_id)
    (token_mean_loss(whole, weights) / whole.loss_mask_B_T.sum()).backward()
    expected = {n: p.grad.clone() for n, p in policy.model.named_parameters()}
    policy.model.zero_grad(set_to_none=True)

    parts = micro_batches(episodes, policy.pad_id, max_tokens=24)
    assert len(parts) >= 3 and all(p.padded_tokens <= 24 for p in parts)
    total = loss_tokens(parts)
    assert total == whole.loss_mask_B_T.sum()
    for part in parts:
        (token_mean_loss(part.batch, weights[part.indices]) / total).backward()
    for name, param in policy.model.named_parameters():
        assert torch.allclose(param.grad, expected[name], atol=1e-6), name
