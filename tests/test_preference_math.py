"""DPO's preference losses (rl_math.preference_loss) against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from llmrl.plugins.rl_math import preference_loss


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


CHOSEN, REJECTED, REF_C, REF_R, BETA = -3.0, -5.0, -4.0, -4.5, 0.5  # h = (-3 + 4) - (-5 + 4.5) = 1.5


def losses(kind: str, smoothing: float = 0.0):
    loss, chosen, rejected = preference_loss(torch.tensor([CHOSEN]), torch.tensor([REJECTED]), torch.tensor([REF_C]),
                                             torch.tensor([REF_R]), BETA, kind, smoothing)
    return float(loss), float(chosen), float(rejected)


def test_dpo_sigmoid_loss_and_implicit_rewards():
    loss, chosen, rejected = losses("sigmoid")
    assert loss == pytest.approx(-log_sigmoid(0.75), abs=1e-6)  # beta * h = 0.75
    assert chosen == pytest.approx(0.5) and rejected == pytest.approx(-0.25)  # beta * (logp - ref)


def test_label_smoothing_and_robust_dpo():
    loss, _, _ = losses("sigmoid", 0.1)
    assert loss == pytest.approx(-0.9 * log_sigmoid(0.75) - 0.1 * log_sigmoid(-0.75), abs=1e-6)
    loss, _, _ = losses("robust", 0.1)
    assert loss == pytest.approx((-0.9 * log_sigmoid(0.75) + 0.1 * log_sigmoid(-0.75)) / 0.8, abs=1e-6)
    assert losses("robust", 0.0)[0] == pytest.approx(losses("sigmoid", 0.0)[0], abs=1e-7)


def test_ipo_is_the_squared_distance_to_half_over_beta():
    assert losses("ipo")[0] == pytest.approx((1.5 - 1 / (2 * BETA)) ** 2, abs=1e-6)  # (1.5 - 1)^2 = 0.25


def test_the_gradient_raises_the_chosen_and_lowers_the_rejected():
    chosen, rejected = torch.tensor([CHOSEN], requires_grad=True), torch.tensor([REJECTED], requires_grad=True)
    loss, _, _ = preference_loss(chosen, rejected, torch.tensor([REF_C]), torch.tensor([REF_R]), BETA)
    loss.sum().backward()
    sigma = 1 / (1 + math.exp(0.75))  # d/dh -log s(beta h) = -beta s(-beta h)
    assert float(chosen.grad) == pytest.approx(-BETA * sigma, abs=1e-6)
    assert float(rejected.grad) == pytest.approx(BETA * sigma, abs=1e-6)


def test_an_unknown_loss_is_refused():
    with pytest.raises(ValueError, match="sigmoid, robust or ipo"):
        losses("hinge")
