"""Loss normalizations, KL, entropy and value losses, with the hand-derived expectation next
to each assert. (The clipped surrogate itself is tested in test_grpo.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from opentinker.services.trainer.losses.entropy import entropy_bonus_loss, entropy_from_logprobs
from opentinker.services.trainer.losses.kl import kl_loss, kl_per_token, kl_reward_penalty
from opentinker.services.trainer.losses.policy_gradient import (
    clipped_policy_loss,
    grpo_loss,
    token_weights,
)
from opentinker.services.trainer.losses.value import explained_variance, value_loss

pytestmark = pytest.mark.unit

LN2 = math.log(2.0)
MASK = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])  # 1 and 3 model tokens


def test_token_weights_of_each_normalization() -> None:
    # sequence: m / |o_b| / B -> row 0: 1/1/2 = 0.5; row 1: 1/3/2 = 1/6 each
    assert torch.allclose(
        token_weights(MASK, "sequence"), torch.tensor([[0.5, 0, 0], [1 / 6, 1 / 6, 1 / 6]])
    )
    # token: m / 4 tokens
    assert torch.allclose(token_weights(MASK, "token"), MASK / 4)
    # constant: m / (B * max_tokens) = m / (2 * 5)
    assert torch.allclose(token_weights(MASK, "constant", max_tokens=5), MASK / 10)
    with pytest.raises(ValueError, match="max_tokens > 0"):
        token_weights(MASK, "constant")


def test_normalizations_weigh_long_sequences_differently() -> None:
    # on-policy (ratio 1) -> surrogate = A on each token; A = [1, 0] -> only token (0, 0) counts
    # sequence: -(1/1 + 0)/2 = -0.5; token: -1/4 = -0.25; constant (max 4): -1/(2*4) = -0.125
    lp = torch.zeros(2, 3)
    adv = torch.tensor([1.0, 0.0])
    assert grpo_loss(lp, lp, adv, MASK, 0.2)[0].item() == pytest.approx(-0.5)
    assert grpo_loss(lp, lp, adv, MASK, 0.2, "token")[0].item() == pytest.approx(-0.25)
    constant = grpo_loss(lp, lp, adv, MASK, 0.2, "constant", max_tokens=4)[0]
    assert constant.item() == pytest.approx(-0.125)


def test_per_token_advantages_and_split_batches_sum_to_the_whole() -> None:
    # per-token A [[2, x, x], [1, -1, 0]] with token weights 1/4: -(2 + 1 - 1 + 0)/4 = -0.5
    lp = torch.zeros(2, 3)
    adv_B_T = torch.tensor([[2.0, 5.0, 5.0], [1.0, -1.0, 0.0]])
    weights = token_weights(MASK, "token")
    whole, stats = clipped_policy_loss(lp, lp, adv_B_T, weights, 0.2)
    assert whole.item() == pytest.approx(-0.5)
    assert stats.tokens == 4
    # rows 0 and 1 on their own, same weights: -2/4 + -(0)/4 = -0.5 in all
    part0, _ = clipped_policy_loss(lp[:1], lp[:1], adv_B_T[:1], weights[:1], 0.2)
    part1, _ = clipped_policy_loss(lp[1:], lp[1:], adv_B_T[1:], weights[1:], 0.2)
    assert (part0 + part1).item() == pytest.approx(whole.item())


def test_unknown_normalization_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown normalization"):
        token_weights(MASK, "batch")  # type: ignore[arg-type]


def test_kl_estimators_k1_and_k3() -> None:
    # log pi = ln 0.5, log pi_ref = ln 0.25 -> log_ratio = ln 2 = 0.6931
    # k1 = ln 2 = 0.6931; k3 = e^{-ln 2} - 1 + ln 2 = 0.5 - 1 + 0.6931 = 0.1931
    # reversed (log_ratio = -ln 2): k1 = -0.6931; k3 = 2 - 1 - 0.6931 = 0.3069 (k3 never < 0)
    new = torch.tensor([[math.log(0.5), math.log(0.25)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.5)]])
    assert torch.allclose(kl_per_token(new, ref, "k1"), torch.tensor([[LN2, -LN2]]))
    assert torch.allclose(
        kl_per_token(new, ref, "k3"), torch.tensor([[0.5 - 1 + LN2, 2 - 1 - LN2]]), atol=1e-6
    )
    # equal policies: 0 for both
    assert kl_per_token(new, new, "k3").abs().max().item() == 0.0
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_per_token(new, ref, "k2")  # type: ignore[arg-type]


def test_kl_loss_gradient_pulls_toward_the_reference() -> None:
    # k3 at log_ratio = ln 2: d/dnew (e^{-x} - 1 + x) = 1 - e^{-x} = 1 - 0.5 = 0.5 (times w = 1)
    # > 0: gradient descent lowers log pi toward log pi_ref. Token 1 is off the mask: grad 0.
    new = torch.tensor([[LN2, 100.0]], requires_grad=True)
    loss = kl_loss(new, torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]), "k3")
    assert loss.item() == pytest.approx(0.5 - 1 + LN2)
    loss.backward()
    assert new.grad is not None
    assert torch.allclose(new.grad, torch.tensor([[0.5, 0.0]]))


def test_kl_reward_penalty_is_minus_coef_times_kl_on_the_mask() -> None:
    # k1 with log_ratio ln 2, coef 0.1: -0.1 * 0.6931 = -0.0693; masked token -> 0
    penalty = kl_reward_penalty(
        torch.tensor([[LN2, LN2]]), torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]),
        coef=0.1, estimator="k1",
    )  # fmt: skip
    assert torch.allclose(penalty, torch.tensor([[-0.1 * LN2, 0.0]]))
    assert not penalty.requires_grad


def test_entropy_and_its_bonus() -> None:
    # uniform over 4 tokens: H = ln 4 = 1.3863; one-hot (almost): H ~ 0
    logp = torch.log_softmax(torch.tensor([[[0.0, 0.0, 0.0, 0.0], [50.0, 0.0, 0.0, 0.0]]]), -1)
    entropy = entropy_from_logprobs(logp)
    assert torch.allclose(entropy, torch.tensor([[math.log(4.0), 0.0]]), atol=1e-5)
    # bonus with weights [0.5, 0.5]: -(0.5 * ln 4 + 0.5 * 0) = -0.6931
    assert entropy_bonus_loss(entropy, torch.tensor([[0.5, 0.5]])).item() == pytest.approx(
        -0.5 * math.log(4.0), abs=1e-5
    )


def test_value_loss_unclipped_and_clipped() -> None:
    # V 1.0, R 2.0, w 1: 0.5 * (1 - 2)^2 = 0.5
    values = torch.tensor([[1.0]], requires_grad=True)
    old, ret, w = torch.tensor([[0.5]]), torch.tensor([[2.0]]), torch.ones(1, 1)
    assert value_loss(values, old, ret, w).item() == pytest.approx(0.5)
    # clip 0.2: the clipped value is 0.5 + clip(0.5, -0.2, 0.2) = 0.7 -> (0.7 - 2)^2 = 1.69;
    # max(1, 1.69) = 1.69 -> 0.5 * 1.69 = 0.845, and the clipped branch has no gradient
    loss = value_loss(values, old, ret, w, clip_range=0.2)
    assert loss.item() == pytest.approx(0.845)
    loss.backward()
    assert values.grad is not None and values.grad.item() == 0.0
    # inside the clip range (V 3.0, old 2.9, R 2): both branches give 1 -> 0.5
    assert value_loss(
        torch.tensor([[3.0]]), torch.tensor([[2.9]]), ret, w, clip_range=0.2
    ).item() == pytest.approx(0.5)


def test_explained_variance() -> None:
    ret, mask = torch.tensor([[1.0, 2.0, 3.0, 99.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # perfect critic: 1 - 0 / Var = 1
    assert explained_variance(torch.tensor([[1.0, 2.0, 3.0, 0.0]]), ret, mask) == pytest.approx(1)
    # constant 2: Var(R - V) = Var([-1, 0, 1]) = 2/3 = Var(R) -> 1 - 1 = 0
    assert explained_variance(torch.full((1, 4), 2.0), ret, mask) == pytest.approx(0.0)
