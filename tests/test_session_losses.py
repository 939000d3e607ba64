"""The session API's losses: hand-derived values beside each assert."""

from __future__ import annotations

import math

import pytest
import torch

from opentinker.services.trainer.losses.cispo import cispo_loss
from opentinker.services.trainer.losses.cross_entropy import weighted_nll_sum
from opentinker.services.trainer.losses.importance_sampling import importance_sampling_loss
from opentinker.services.trainer.losses.ppo_token import ppo_token_loss


def test_cross_entropy_is_the_weighted_sum_of_negative_logprobs() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -float("inf")], [-0.5, -0.25, -4.0]])
    weights = torch.tensor([[1.0, 0.5, 0.0], [0.0, 2.0, 1.0]])
    # 1*1 + 0.5*2 + (weight 0: -inf ignored) + 0 + 2*0.25 + 1*4 = 1 + 1 + 0.5 + 4 = 6.5
    assert weighted_nll_sum(logprobs, weights).item() == pytest.approx(6.5)


def test_cross_entropy_gradient_is_minus_the_weight() -> None:
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    weighted_nll_sum(logprobs, torch.tensor([[3.0, 0.0]])).backward()
    # d/dlp (-(3*lp0 + 0*lp1)) = [-3, 0]
    assert logprobs.grad.tolist() == [[-3.0, 0.0]]


def test_importance_sampling_weighs_advantages_by_the_ratio() -> None:
    logprobs = torch.tensor([[math.log(0.5), math.log(0.2), 0.0]], requires_grad=True)
    sampling = torch.tensor([[math.log(0.25), math.log(0.2), 5.0]])
    advantages = torch.tensor([[1.0, -2.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss = importance_sampling_loss(logprobs, sampling, advantages, mask)
    # ratios 0.5/0.25 = 2 and 1 (third masked): -(2*1 + 1*(-2)) = 0
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    loss.backward()
    # d/dlp -(r*A) = -r*A: [-2, +2, 0]
    assert logprobs.grad[0].tolist() == pytest.approx([-2.0, 2.0, 0.0])


def test_ppo_clips_the_ratio_between_its_thresholds() -> None:
    # ratios 1.5, 0.5, 1.1 with advantages +1, -1, +1; clip [0.8, 1.2]
    logprobs = torch.log(torch.tensor([[0.6, 0.2, 0.55]])).requires_grad_(True)
    sampling = torch.log(torch.tensor([[0.4, 0.4, 0.5]]))
    advantages = torch.tensor([[1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3)
    loss, stats = ppo_token_loss(logprobs, sampling, advantages, mask, clip_low=0.8, clip_high=1.2)
    # token 0: min(1.5*1, 1.2*1) = 1.2; token 1: min(0.5*-1, 0.8*-1) = -0.8;
    # token 2: min(1.1, 1.1) = 1.1  -> loss = -(1.2 - 0.8 + 1.1) = -1.5
    assert loss.item() == pytest.approx(-1.5, abs=1e-6)
    assert stats.clip_fraction == pytest.approx(2 / 3)  # tokens 0 and 1 outside [0.8, 1.2]
    loss.backward()
    # clipped tokens have no gradient; token 2: -r*A = -1.1
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, 0.0, -1.1], abs=1e-6)


def test_ppo_refuses_thresholds_that_exclude_one() -> None:
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="clip_low"):
        ppo_token_loss(x, x, x, x, clip_low=1.1, clip_high=1.2)


def test_cispo_weighs_every_tokens_gradient_by_its_clipped_ratio() -> None:
    # ratios: 0.5/0.25 = 2 (clipped to 1.2), 0.5/0.5 = 1, 0.1/0.5 = 0.2 (clipped to 0.8);
    # the last position is masked out.
    logprobs = torch.tensor(
        [[math.log(0.5), math.log(0.5), math.log(0.1), 0.0]], requires_grad=True
    )
    sampling = torch.tensor([[math.log(0.25), math.log(0.5), math.log(0.5), -9.0]])
    advantages = torch.tensor([[1.0, -2.0, 1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, stats = cispo_loss(logprobs, sampling, advantages, mask, clip_low=0.8, clip_high=1.2)
    # -(1.2*1*ln0.5 + 1*(-2)*ln0.5 + 0.8*1*ln0.1) = -(-0.8*ln0.5 + 0.8*ln0.1)
    #   = 0.8*ln0.5 - 0.8*ln0.1 = 0.8*ln5
    assert loss.item() == pytest.approx(0.8 * math.log(5), rel=1e-5)
    assert stats.clip_fraction == pytest.approx(2 / 3)  # 2 of the 3 masked-in tokens
    loss.backward()
    # d/dlp: -(w * A) per token, clipped tokens keep their gradient (unlike ppo): [-1.2, 2, -0.8, 0]
    assert logprobs.grad[0].tolist() == pytest.approx([-1.2, 2.0, -0.8, 0.0])
    with pytest.raises(ValueError, match="clip_low"):
        cispo_loss(logprobs, sampling, advantages, mask, clip_low=1.1, clip_high=1.2)
