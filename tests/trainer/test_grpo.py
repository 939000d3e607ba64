"""GRPO advantages and loss, with the hand-derived expectation next to each assert."""

from __future__ import annotations

import math

import pytest
import torch

from opentinker.services.trainer.estimators.grpo import group_advantages
from opentinker.services.trainer.losses.policy_gradient import grpo_loss
from opentinker.services.trainer.rl.batch import Episode, collate
from opentinker.services.trainer.rl.training import episode_advantages

pytestmark = pytest.mark.unit


def test_advantages_of_a_balanced_group_are_plus_minus_one() -> None:
    # rewards [1,0,0,1]: mean 0.5, population std 0.5 -> (r - 0.5) / 0.5 = [1, -1, -1, 1]
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    assert torch.allclose(adv, torch.tensor([[1.0, -1.0, -1.0, 1.0]]), atol=1e-5)


def test_advantages_are_normalized_per_group() -> None:
    # group 0: [0, 0, 0, 3] -> mean 0.75, std sqrt((3*0.75^2 + 2.25^2)/4) = sqrt(1.6875) = 1.299
    #   -> [-0.577, -0.577, -0.577, 1.732]
    # group 1: [2, 4, 2, 4] -> mean 3, std 1 -> [-1, 1, -1, 1] (scale of group 0 does not leak)
    adv = group_advantages(torch.tensor([[0.0, 0.0, 0.0, 3.0], [2.0, 4.0, 2.0, 4.0]]))
    s = math.sqrt(1.6875)
    expected = torch.tensor([[-0.75 / s, -0.75 / s, -0.75 / s, 2.25 / s], [-1.0, 1.0, -1.0, 1.0]])
    assert torch.allclose(adv, expected, atol=1e-5)


def test_a_group_with_equal_rewards_gets_zero_advantage() -> None:
    # all rewards 1 -> r - mean = 0 -> 0 / (0 + eps) = 0 exactly, not nan
    adv = group_advantages(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert torch.equal(adv, torch.zeros(2, 3))


def test_advantages_need_groups_by_samples() -> None:
    with pytest.raises(ValueError, match="groups, samples"):
        group_advantages(torch.tensor([1.0, 0.0]))


def test_episode_advantages_group_by_group_index_in_any_order() -> None:
    def ep(group: int, reward: float) -> Episode:
        return Episode(group, 0, [1, 2], 1, [0.0], [1], reward, False)

    # group 0 rewards [1, 0] -> [1, -1]; group 1 rewards [0, 0] -> [0, 0]; interleaved order kept
    adv = episode_advantages([ep(0, 1.0), ep(1, 0.0), ep(0, 0.0), ep(1, 0.0)])
    assert torch.allclose(adv, torch.tensor([1.0, 0.0, -1.0, 0.0]), atol=1e-5)


def test_on_policy_loss_is_minus_mean_advantage_weighted_by_sequence() -> None:
    # new == old -> ratio 1 -> surrogate = A per token; per-sequence mean = A; loss = -mean(A)
    # A = [2, -1] -> loss = -(2 - 1) / 2 = -0.5
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    loss, stats = grpo_loss(lp, lp, torch.tensor([2.0, -1.0]), torch.ones(2, 3), 0.2)
    assert loss.item() == pytest.approx(-0.5)
    assert stats.clip_fraction == 0.0  # ratio 1 is inside [0.8, 1.2]
    assert stats.ratio_mean == pytest.approx(1.0)


def test_sequence_mean_gives_each_sequence_equal_weight() -> None:
    # seq 0 has 1 masked token, seq 1 has 3; on-policy, A = [1, 1]
    # sequence-mean: (1/1 + 3/3) / 2 = 1 -> loss -1  (token-mean would also be 1 here, but with
    # A = [1, 0]: sequence-mean -> -(1 + 0)/2 = -0.5, token-mean would give -(1)/4 = -0.25)
    lp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    loss, _ = grpo_loss(lp, lp, torch.tensor([1.0, 0.0]), mask, 0.2)
    assert loss.item() == pytest.approx(-0.5)


def test_ratio_above_the_clip_range_with_positive_advantage_is_clipped() -> None:
    # new - old = ln 2 -> ratio 2; A = 1: min(2 * 1, clip(2, 0.8, 1.2) * 1) = 1.2 -> loss -1.2
    new = torch.tensor([[math.log(2.0)]], requires_grad=True)
    loss, stats = grpo_loss(new, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), 0.2)
    assert loss.item() == pytest.approx(-1.2)
    assert stats.clip_fraction == 1.0
    assert stats.ratio_mean == pytest.approx(2.0)
    loss.backward()
    # the clipped branch is constant: no gradient pushes the ratio further up
    assert new.grad is not None and new.grad.item() == 0.0


def test_ratio_above_the_clip_range_with_negative_advantage_is_not_clipped() -> None:
    # ratio 2, A = -1: min(2 * -1, 1.2 * -1) = min(-2, -1.2) = -2 -> loss +2 (pessimistic bound)
    new = torch.tensor([[math.log(2.0)]], requires_grad=True)
    loss, _ = grpo_loss(new, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), 0.2)
    assert loss.item() == pytest.approx(2.0)
    loss.backward()
    # d/dnew of -(ratio * A) = -A * ratio = 2: gradient descent lowers the logprob
    assert new.grad is not None and new.grad.item() == pytest.approx(2.0)


def test_ratio_below_the_clip_range_with_negative_advantage_is_clipped() -> None:
    # ratio 0.5, A = -1: min(0.5 * -1, clip(0.5) = 0.8 * -1) = min(-0.5, -0.8) = -0.8 -> loss 0.8
    new = torch.tensor([[math.log(0.5)]])
    loss, stats = grpo_loss(new, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), 0.2)
    assert loss.item() == pytest.approx(0.8)
    assert stats.clip_fraction == 1.0


def test_masked_tokens_contribute_nothing() -> None:
    # the second token is masked: any value there (even -inf logprobs) leaves loss and grad alone
    new = torch.tensor([[-1.0, -1e9]], requires_grad=True)
    old = torch.tensor([[-1.0, float("-inf")]])
    loss, stats = grpo_loss(new, old, torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]), 0.2)
    assert loss.item() == pytest.approx(-1.0)  # only token 0: ratio 1, A = 1
    assert stats.ratio_mean == pytest.approx(1.0)
    loss.backward()
    assert new.grad is not None and new.grad[0, 1].item() == 0.0
    assert not torch.isnan(new.grad).any()


def test_gradient_raises_logprobs_of_positive_advantage_tokens() -> None:
    # on-policy, d loss / d new_t = -A / n_tokens: A > 0 -> negative grad -> descent raises it
    new = torch.zeros(2, 2, requires_grad=True)
    loss, _ = grpo_loss(new, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), torch.ones(2, 2), 0.2)
    loss.backward()
    # loss = -(1/2)(1/2 sum_t r_0t - 1/2 sum_t r_1t) -> grad = -1/4 for seq 0, +1/4 for seq 1
    assert new.grad is not None
    assert torch.allclose(new.grad, torch.tensor([[-0.25, -0.25], [0.25, 0.25]]))


def test_loss_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="shape mismatch"):
        grpo_loss(torch.zeros(2, 3), torch.zeros(2, 2), torch.zeros(2), torch.ones(2, 3), 0.2)


def test_collate_aligns_completion_fields_to_next_token_positions() -> None:
    # tokens [5, 6 | 7, 8]: prompt 2, completion [7 (model), 8 (env)]
    # position t predicts token t+1: token 7 at t=1, token 8 at t=2
    a = Episode(0, 0, [5, 6, 7, 8], 2, [-0.1, 0.0], [1, 0], 1.0, False)
    b = Episode(0, 0, [5, 9], 1, [-0.3], [1], 0.0, False)  # shorter: right-padded with 0
    batch = collate([a, b], pad_id=0)
    assert batch.tokens_B_L.tolist() == [[5, 6, 7, 8], [5, 9, 0, 0]]
    assert batch.attention_mask_B_L.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch.loss_mask_B_T.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    assert torch.allclose(
        batch.old_logprobs_B_T, torch.tensor([[0.0, -0.1, 0.0], [-0.3, 0.0, 0.0]])
    )


def test_collate_rejects_a_trajectory_whose_fields_disagree() -> None:
    bad = Episode(0, 0, [5, 6, 7], 1, [-0.1], [1], 0.0, False)  # 2 completion tokens, 1 entry
    with pytest.raises(ValueError, match="malformed trajectory"):
        collate([bad], pad_id=0)


@pytest.mark.parametrize("reward,n", [(0.9, 3), (0.3, 6), (0.1, 7)])
def test_equal_rewards_whose_float32_mean_is_not_exact_still_get_zero_advantage(
    reward: float, n: int
) -> None:
    """In float32 the mean of three 0.9s is not 0.9: the std came out ~5e-8, not 0, and every
    member got a same-signed advantage (+0.056 for three 0.9s), which trained the group up."""
    adv = group_advantages(torch.full((1, n), reward))
    assert torch.equal(adv, torch.zeros(1, n))
    # A real difference, however small against the rewards, still counts.
    close = group_advantages(torch.tensor([[0.9, 0.9, 0.9 + 1e-4]]))
    assert close[0, 2] > 1.0 and close[0, 0] < 0
