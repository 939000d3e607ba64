"""The session API's losses: hand-derived values beside each assert."""

from __future__ import annotations

import math

import pytest
import torch

from opentinker.services.trainer.losses.cispo import cispo_loss
from opentinker.services.trainer.losses.cross_entropy import weighted_nll_sum
from opentinker.services.trainer.losses.gspo import gspo_loss
from opentinker.services.trainer.losses.importance_sampling import importance_sampling_loss
from opentinker.services.trainer.losses.ppo_token import ppo_token_loss
from opentinker.services.trainer.losses.stable_reinforce import stable_reinforce_loss


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


def test_gspo_gives_each_token_its_sequences_geometric_mean_ratio() -> None:
    # sequence 0: token ratios 0.5/0.25 = 2 and 1 -> s = sqrt(2) ~ 1.414 (above 1.2: clipped);
    #   its third position is padding (mask 0).
    # sequence 1: ratios 1.21 and 1 under the ratio mask -> s = sqrt(1.21) = 1.1 (inside);
    #   its third token (ratio 3) is outside the ratio mask but still trained, with s = 1.1.
    logprobs = torch.log(torch.tensor([[0.5, 0.4, 1.0], [0.605, 0.3, 0.9]])).requires_grad_(True)
    sampling = torch.log(torch.tensor([[0.25, 0.4, 0.7], [0.5, 0.3, 0.3]]))
    advantages = torch.tensor([[1.0, 1.0, 9.0], [-1.0, -1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    ratio_mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    loss, stats = gspo_loss(
        logprobs, sampling, advantages, mask, ratio_mask, clip_low=0.8, clip_high=1.2
    )
    # seq 0: min(1.414*1, 1.2*1) = 1.2 per token -> 2.4; seq 1: -1.1 - 1.1 + 1.1 = -1.1
    # loss = -(2.4 - 1.1) = -1.3
    assert loss.item() == pytest.approx(-1.3, abs=1e-5)
    assert stats.clip_fraction == pytest.approx(2 / 5)  # sequence 0's 2 of the 5 tokens
    loss.backward()
    # clipped tokens (seq 0) have no gradient; seq 1: d/dlp -(s * exp(lp - sg(lp)) * A) = -s*A
    assert logprobs.grad.flatten().tolist() == pytest.approx(
        [0.0, 0.0, 0.0, 1.1, 1.1, -1.1], abs=1e-5
    )
    with pytest.raises(ValueError, match="clip_low"):
        gspo_loss(logprobs, sampling, advantages, mask, ratio_mask, clip_low=1.1, clip_high=1.2)


def test_stable_reinforce_truncates_the_ratio_at_one_and_adds_the_kl() -> None:
    # ratios 0.5/0.25 = 2 (weight cut to 1) and 0.2/0.4 = 0.5; the third token is masked out
    logprobs = torch.log(torch.tensor([[0.5, 0.2, 0.4]])).requires_grad_(True)
    sampling = torch.log(torch.tensor([[0.25, 0.4, 0.1]]))
    advantages = torch.tensor([[1.0, -1.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = stable_reinforce_loss(logprobs, sampling, advantages, mask, kl_coeff=0.1)
    # policy gradient: -(1*1*ln0.5 + 0.5*(-1)*ln0.2) = ln2 + 0.5*ln0.2 = ln(2/sqrt5)
    # kl (r - 1 - ln r): (2 - 1 - ln2) + (0.5 - 1 + ln2) = 0.5, times 0.1 = 0.05
    assert loss.item() == pytest.approx(math.log(2 / math.sqrt(5)) + 0.05, abs=1e-6)
    assert stats.kl == pytest.approx(0.5, abs=1e-6)
    assert stats.truncated_fraction == pytest.approx(1 / 2)
    loss.backward()
    # d/dlp: -w*A + 0.1*(r - 1) = [-1 + 0.1, 0.5 - 0.05, 0] = [-0.9, 0.45, 0]
    assert logprobs.grad[0].tolist() == pytest.approx([-0.9, 0.45, 0.0], abs=1e-6)
    # on-policy (ratio 1 everywhere) it is plain REINFORCE: gradient -A, no KL
    on_policy = torch.log(torch.tensor([[0.5, 0.2]])).requires_grad_(True)
    loss, stats = stable_reinforce_loss(
        on_policy, on_policy.detach(), torch.tensor([[2.0, -1.0]]), torch.ones(1, 2), kl_coeff=1.0
    )
    loss.backward()
    assert on_policy.grad[0].tolist() == pytest.approx([-2.0, 1.0]) and stats.kl == 0.0
    with pytest.raises(ValueError, match="kl_coeff"):
        stable_reinforce_loss(logprobs, sampling, advantages, mask, kl_coeff=-1.0)
