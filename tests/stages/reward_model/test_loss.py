"""Golden values of the Bradley-Terry loss."""

import pytest
import torch

from rlpipe.stages.reward_model.loss import bradley_terry_loss

R_C = torch.tensor([2.0, 0.0])
R_R = torch.tensor([0.0, 1.0])


def test_bt_loss_golden():
    # diff = [2, -1]; -log sigmoid(2) = log(1 + e^-2) = 0.126928; -log sigmoid(-1) = log(1 + e) = 1.313262
    # (0.126928 + 1.313262) / 2 = 0.7200948 (fp32 loss: ~1e-7 rounding, hence abs 1e-6)
    loss, stats = bradley_terry_loss(R_C, R_R)
    assert float(loss) == pytest.approx(0.7200948, abs=1e-6)
    assert stats["accuracy"] == 0.5  # only pair 0 has r_c > r_r
    assert stats["reward_margin"] == pytest.approx(0.5)  # mean([2, -1])


def test_bt_loss_margin_and_centering_golden():
    # margin [1, 0]: diff = [1, -1] -> (log(1 + e^-1) + log(1 + e)) / 2 = (0.313262 + 1.313262) / 2
    #   = 0.8132617; centering 0.1 * mean([(2+0)^2, (0+1)^2]) = 0.1 * 2.5 = 0.25
    loss, stats = bradley_terry_loss(R_C, R_R, torch.tensor([1.0, 0.0]), center_coef=0.1)
    assert float(loss) == pytest.approx(0.8132617 + 0.25, abs=1e-6)
    assert stats["bt_loss"] == pytest.approx(0.8132617, abs=1e-6)


def test_bt_loss_gradient_pushes_chosen_up():
    r_c = torch.tensor([0.0], requires_grad=True)
    r_r = torch.tensor([0.0], requires_grad=True)
    loss, _ = bradley_terry_loss(r_c, r_r)
    loss.backward()
    # d/dx -log sigmoid(x) = -(1 - sigmoid(x)) = -0.5 at x = 0
    assert float(r_c.grad) == pytest.approx(-0.5)
    assert float(r_r.grad) == pytest.approx(0.5)


def test_bt_loss_is_stable_for_large_gaps():
    loss, _ = bradley_terry_loss(torch.tensor([-200.0]), torch.tensor([200.0]))
    assert float(loss) == pytest.approx(400.0)  # -log sigmoid(-400) = 400 + log(1 + e^-400)
