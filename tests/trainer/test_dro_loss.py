"""Tinker's ``dro`` loss as a pure function, against hand-derived values."""

from __future__ import annotations

import pytest
import torch

from opentinker.services.trainer.losses.dro import dro_loss

pytestmark = pytest.mark.unit


def test_dro_is_the_policy_gradient_minus_a_quadratic_pull_to_the_sampler() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    q = torch.tensor([[-1.5, -2.0, 0.0]])
    adv = torch.tensor([[2.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the last position is padding
    loss, mean_sq = dro_loss(logp, q, adv, mask, beta=0.5)
    # -( (-1)(2) - 0.25 * 0.25 ) - ( (-2)(-1) - 0.25 * 0 ) = 2.0625 - 2 = 0.0625
    assert float(loss.detach()) == pytest.approx(0.0625)
    assert mean_sq == pytest.approx((0.25 + 0.0) / 2)
    loss.backward()
    # d/dlogp = -(A - beta * (logp - q)): -(2 - 0.5*0.5) = -1.75; -(-1 - 0) = 1; padding 0
    assert logp.grad.tolist() == [pytest.approx([-1.75, 1.0, 0.0])]


def test_dro_with_beta_zero_is_plain_reinforce_and_a_negative_beta_is_refused() -> None:
    logp = torch.tensor([[-1.0, -3.0]], requires_grad=True)
    q = torch.tensor([[-9.0, -9.0]])
    adv = torch.tensor([[1.0, 1.0]])
    loss, _ = dro_loss(logp, q, adv, torch.ones(1, 2), beta=0.0)
    assert float(loss.detach()) == pytest.approx(4.0)  # -sum(logp * A)
    with pytest.raises(ValueError, match="beta"):
        dro_loss(logp, q, adv, torch.ones(1, 2), beta=-1.0)
