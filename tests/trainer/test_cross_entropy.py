"""The weighted cross entropy, against hand-derived values."""

from __future__ import annotations

import math

import pytest
import torch

from opentinker.services.trainer.losses.cross_entropy import cross_entropy
from opentinker.services.trainer.model.logprobs import target_logprobs_and_entropy

pytestmark = pytest.mark.unit


def test_weighted_mean_over_weighted_tokens() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]], requires_grad=True)
    weights = torch.tensor([[0.0, 1.0, 1.0], [2.0, 0.0, 0.0]])
    loss = cross_entropy(logp, weights)
    # -(1*-2 + 1*-3 + 2*-4) / (1 + 1 + 2) = 13 / 4 = 3.25
    assert loss.item() == pytest.approx(3.25)
    loss.backward()
    # d loss / d logp = -w / sum(w) = -w / 4
    assert logp.grad is not None
    assert logp.grad.tolist() == [[0.0, -0.25, -0.25], [-0.5, 0.0, 0.0]]


def test_all_zero_weights_give_zero_loss_not_nan() -> None:
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss = cross_entropy(logp, torch.zeros(1, 2))
    assert loss.item() == 0.0  # -(0) / tiny = 0
    loss.backward()
    assert logp.grad is not None and logp.grad.abs().sum().item() == 0.0


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="same shape"):
        cross_entropy(torch.zeros(2, 3), torch.zeros(2, 2))


def test_target_logprobs_from_logits_are_the_log_softmax_at_the_next_token() -> None:
    # Two-token vocabulary; logits at t=0 are [0, ln 3]: p = [1/4, 3/4].
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, 5.0], [9.0, 9.0]]])
    tokens = torch.tensor([[0, 1, 0]])
    logp, _ = target_logprobs_and_entropy(logits[:, :-1], tokens[:, 1:], 1.0)
    # position 0 predicts token 1: ln(3/4); position 1 predicts token 0 from equal logits: ln(1/2)
    assert logp.shape == (1, 2)
    assert logp[0, 0].item() == pytest.approx(math.log(0.75))
    assert logp[0, 1].item() == pytest.approx(math.log(0.5))
