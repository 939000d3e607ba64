"""Advantage estimators, with the hand-derived expectation next to each assert.
(GRPO's group normalization is tested in test_grpo.py.)"""

from __future__ import annotations

import pytest
import torch

from opentinker.services.trainer.estimators.gae import gae_advantages
from opentinker.services.trainer.estimators.reinforce import batch_baseline_advantages
from opentinker.services.trainer.estimators.rloo import rloo_advantages
from opentinker.services.trainer.estimators.turn_returns import discounted_returns, token_returns

pytestmark = pytest.mark.unit


def test_rloo_baseline_is_the_mean_of_the_other_samples() -> None:
    # group 0 [1, 0, 0, 1]: for a 1 the others average (1+0+0)/3 = 1/3 -> 2/3; for a 0 the
    #   others average 2/3 -> -2/3
    # group 1 [3, 0, 0]: for the 3 the others average 0 -> 3; for a 0, (3+0)/2 = 1.5 -> -1.5
    adv = rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    assert torch.allclose(adv, torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3]]), atol=1e-6)
    adv = rloo_advantages(torch.tensor([[3.0, 0.0, 0.0]]))
    assert torch.allclose(adv, torch.tensor([[3.0, -1.5, -1.5]]), atol=1e-6)


def test_rloo_keeps_the_reward_scale_and_zeroes_equal_groups() -> None:
    # [10, 0]: 10 - 0 = 10, 0 - 10 = -10 (no std division); [2, 2] -> 0, 0
    adv = rloo_advantages(torch.tensor([[10.0, 0.0], [2.0, 2.0]]))
    assert torch.equal(adv, torch.tensor([[10.0, -10.0], [0.0, 0.0]]))


def test_rloo_needs_two_samples_per_group() -> None:
    with pytest.raises(ValueError, match="at least 2 samples"):
        rloo_advantages(torch.tensor([[1.0], [0.0]]))


def test_reinforce_baseline_is_the_batch_mean() -> None:
    # [1, 0, 0, 3]: mean 1 -> [0, -1, -1, 2]
    adv = batch_baseline_advantages(torch.tensor([1.0, 0.0, 0.0, 3.0]))
    assert torch.equal(adv, torch.tensor([0.0, -1.0, -1.0, 2.0]))
    with pytest.raises(ValueError, match="non-empty"):
        batch_baseline_advantages(torch.tensor([]))


def test_gae_with_gamma_and_lambda_one_is_return_minus_value() -> None:
    # rewards [0, 0, 1], V = 0.5 everywhere, gamma = lambda = 1:
    # t=2: delta = 1 + 0 - 0.5 = 0.5, A = 0.5; t=1: delta = 0 + 0.5 - 0.5 = 0, A = 0 + 0.5 = 0.5;
    # t=0: same, A = 0.5. Returns A + V = 1 everywhere (the final reward).
    adv, ret = gae_advantages(
        torch.tensor([[0.0, 0.0, 1.0]]), torch.full((1, 3), 0.5), torch.ones(1, 3),
        gamma=1.0, lam=1.0,
    )  # fmt: skip
    assert torch.allclose(adv, torch.full((1, 3), 0.5))
    assert torch.allclose(ret, torch.ones(1, 3))


def test_gae_discounts_with_gamma_and_lambda() -> None:
    # rewards [0, 0, 1], V [0.1, 0.4, 0.6], gamma = lambda = 0.5 (gamma * lambda = 0.25):
    # t=2: delta = 1 - 0.6 = 0.4,              A2 = 0.4
    # t=1: delta = 0 + 0.5*0.6 - 0.4 = -0.1,    A1 = -0.1 + 0.25*0.4 = 0.0
    # t=0: delta = 0 + 0.5*0.4 - 0.1 = 0.1,     A0 = 0.1 + 0.25*0.0 = 0.1
    # returns A + V = [0.2, 0.4, 1.0]
    adv, ret = gae_advantages(
        torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.1, 0.4, 0.6]]), torch.ones(1, 3),
        gamma=0.5, lam=0.5,
    )  # fmt: skip
    assert torch.allclose(adv, torch.tensor([[0.1, 0.0, 0.4]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.2, 0.4, 1.0]]), atol=1e-6)


def test_gae_skips_tokens_off_the_mask() -> None:
    # mask [1, 0, 1]: position 1 (an env token) is skipped whatever its reward and value.
    # gamma 0.9, lambda 1: t=2: delta = 1 - 0.5 = 0.5, A2 = 0.5;
    # t=0 (next model token is t=2): delta = 0 + 0.9*0.5 - 0.5 = -0.05, A0 = -0.05 + 0.9*0.5 = 0.4
    # returns [0.4 + 0.5, 0, 0.5 + 0.5] = [0.9, 0, 1.0] (0.9 = the reward discounted once)
    adv, ret = gae_advantages(
        torch.tensor([[0.0, 9.0, 1.0]]), torch.tensor([[0.5, 7.0, 0.5]]),
        torch.tensor([[1.0, 0.0, 1.0]]), gamma=0.9, lam=1.0,
    )  # fmt: skip
    assert torch.allclose(adv, torch.tensor([[0.4, 0.0, 0.5]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.9, 0.0, 1.0]]), atol=1e-6)


def test_gae_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="shape mismatch"):
        gae_advantages(torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1, 3), gamma=1, lam=1)


def test_discounted_returns_per_turn() -> None:
    # rewards [1, 0, 2], gamma 0.5: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5
    assert discounted_returns([1.0, 0.0, 2.0], 0.5) == pytest.approx([1.5, 1.0, 2.0])
    # gamma 1: sums of what follows: [3, 2, 2]
    assert discounted_returns([1.0, 0.0, 2.0], 1.0) == pytest.approx([3.0, 2.0, 2.0])


def test_token_returns_credit_each_token_with_its_turn() -> None:
    # turns end after completion tokens 2, 3, 5 (exclusive); 6 tokens: token 5 is a trailing
    # observation -> last turn. Returns [1.5, 1, 2] (above) -> [1.5, 1.5, 1, 2, 2, 2]
    out = token_returns([1.0, 0.0, 2.0], [2, 3, 5], 6, 0.5)
    assert torch.allclose(out, torch.tensor([1.5, 1.5, 1.0, 2.0, 2.0, 2.0]))


def test_token_returns_reject_bad_turn_ends() -> None:
    with pytest.raises(ValueError, match="one turn end per turn reward"):
        token_returns([1.0, 0.0], [2], 4, 1.0)
    with pytest.raises(ValueError, match="must not decrease"):
        token_returns([1.0, 0.0], [3, 2], 4, 1.0)
    with pytest.raises(ValueError, match="must not decrease"):
        token_returns([1.0], [5], 4, 1.0)
