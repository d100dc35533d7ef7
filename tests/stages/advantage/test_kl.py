"""KL estimators, KL-in-reward token rewards and the KL coefficient controller."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch

from rlpipe.stages.advantage.config import KLConfig, KLEstimator
from rlpipe.stages.advantage.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    adaptive_kl_beta,
    kl,
    kl_token_rewards,
    last_token_rewards,
    next_kl_beta,
)


def test_kl_estimators_golden():
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.1, -1.5], dtype=torch.float64)  # lr = [0.1, -0.5]
    torch.testing.assert_close(kl("k1", logp, ref), torch.tensor([0.1, -0.5], dtype=torch.float64))
    torch.testing.assert_close(kl("k2", logp, ref), torch.tensor([0.005, 0.125], dtype=torch.float64))
    expected_k3 = [math.exp(-0.1) - 1 + 0.1, math.exp(0.5) - 1 - 0.5]  # 0.0048374, 0.1487213
    torch.testing.assert_close(kl("k3", logp, ref), torch.tensor(expected_k3, dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl("k4", logp, ref)


def test_abs_and_k3_plus_golden():
    logp = torch.tensor([-1.0, -2.0, -0.3], dtype=torch.float64)
    ref = torch.tensor([-1.1, -1.5, -0.3], dtype=torch.float64)  # lr = [0.1, -0.5, 0]
    # abs = |lr|
    torch.testing.assert_close(kl("abs", logp, ref), torch.tensor([0.1, 0.5, 0.0], dtype=torch.float64))
    # k3+ has k3's value: exp(-lr) - 1 + lr = [0.0048374, 0.1487213, 0]
    expected_k3 = [math.exp(-0.1) - 1 + 0.1, math.exp(0.5) - 1 - 0.5, 0.0]
    torch.testing.assert_close(kl("k3+", logp, ref), torch.tensor(expected_k3, dtype=torch.float64))


def test_k3_plus_has_k3_value_and_k2_gradient():
    # Autograd check on lr spanning both signs and a large negative value, where the gradients of
    # k3 (1 - exp(-lr): -147.4 at lr = -5) and k2 (lr: -5) differ most. Unclamped: the default
    # clamp cuts k3 at 10 (lr = -5 gives 142) and with it the gradient there.
    lr = torch.tensor([-5.0, -0.5, 0.0, 0.1, 2.0], dtype=torch.float64)
    ref = torch.tensor([-1.0, -2.0, -0.5, -3.0, -4.0], dtype=torch.float64)
    grads = {}
    for name in ("k2", "k3", "k3+"):
        logp = (ref + lr).requires_grad_(True)
        value = kl(name, logp, ref, clamp=False)
        value.sum().backward()
        grads[name] = logp.grad
        if name == "k3+":
            torch.testing.assert_close(value.detach(), kl("k3", ref + lr, ref, clamp=False), atol=0, rtol=0)
    torch.testing.assert_close(grads["k3+"], grads["k2"], atol=0, rtol=0)
    torch.testing.assert_close(grads["k2"], lr)  # d/dlogp 0.5 lr^2 = lr
    torch.testing.assert_close(grads["k3"], 1 - torch.exp(-lr))  # k3's own gradient differs
    assert not torch.allclose(grads["k3"], grads["k2"])


def test_kl_estimator_names_are_one_list():
    # The config Literal (advantage and optimize configs) and the registry name the same estimators.
    from rlpipe.stages.optimize.config import OptimizeConfig

    assert set(get_args(KLEstimator)) == set(KL_ESTIMATORS) == {"k1", "k2", "k3", "abs", "k3+"}
    assert KLConfig.model_fields["estimator"].annotation is KLEstimator
    assert OptimizeConfig.model_fields["kl_estimator"].annotation is KLEstimator


def test_kl_in_reward_worked_example():
    # R_RM = 0.8, KL = 0.05, beta = 6 -> R_total = 0.8 - 6 * 0.05 = 0.5 (one token carrying all the KL)
    out = kl_token_rewards(torch.tensor([0.8]), torch.tensor([[0.05]]), torch.ones(1, 1), beta=6.0)
    assert out.item() == pytest.approx(0.5)
    # Spread over tokens with padding: row 0 has 3 tokens (KL 0.01, 0.02, 0.02 = 0.05), row 1 has 1.
    kl_t = torch.tensor([[0.01, 0.02, 0.02], [0.05, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.float64)
    r = kl_token_rewards(torch.tensor([0.8, 0.8], dtype=torch.float64), kl_t, mask, beta=6.0)
    expected = torch.tensor([[-0.06, -0.12, 0.8 - 0.12], [0.5, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(r, expected)
    torch.testing.assert_close(r.sum(-1), torch.tensor([0.5, 0.5], dtype=torch.float64))


def test_last_token_rewards_places_r_at_the_end_and_handles_empty_rows():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.float64)
    out = last_token_rewards(torch.tensor([2.0, 5.0, -1.0], dtype=torch.float64), mask)
    torch.testing.assert_close(out, torch.tensor([[0, 2.0, 0], [0, 0, 0], [0, 0, -1.0]], dtype=torch.float64))


def test_adaptive_kl_controller_golden_steps():
    # KL above target: e = clip(0.15 / 0.1 - 1, -0.2, 0.2) = 0.2; beta = 0.1 * (1 + 0.2 * 64 / 1000)
    assert adaptive_kl_beta(0.1, 0.15, target=0.1, n_steps=64, horizon=1000) == pytest.approx(0.10128)
    # KL below target: e = 0.09 / 0.1 - 1 = -0.1 (inside the clip); beta = 0.1 * (1 - 0.1 * 0.064)
    assert adaptive_kl_beta(0.1, 0.09, target=0.1, n_steps=64, horizon=1000) == pytest.approx(0.09936)
    # far below: clipped at -0.2
    assert adaptive_kl_beta(0.1, 0.0, target=0.1, n_steps=64, horizon=1000) == pytest.approx(0.1 * (1 - 0.2 * 0.064))
    assert next_kl_beta("fixed", 0.1, 10.0, target=0.1, n_steps=64, horizon=1000) == 0.1
    assert next_kl_beta("adaptive", 0.1, 0.15, target=0.1, n_steps=64, horizon=1000) == pytest.approx(0.10128)
    assert set(KL_CONTROLLERS) == {"fixed", "adaptive"}
    with pytest.raises(ValueError, match="target"):
        adaptive_kl_beta(0.1, 0.1, target=None, n_steps=1)
    with pytest.raises(ValueError, match="unknown KL controller"):
        next_kl_beta("pid", 0.1, 0.1)


def test_k3_plus_value_is_clamped_like_k3_and_keeps_k2_gradient():
    # lr = -5: k3 = e^5 - 6 = 142.4, clamped to K3_VALUE_BOUND = 10; the gradient stays k2's (lr).
    ref = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    logp = (ref + torch.tensor([-5.0, 0.1], dtype=torch.float64)).requires_grad_(True)
    value = kl("k3+", logp, ref)
    value.sum().backward()
    torch.testing.assert_close(value.detach(), torch.tensor([10.0, math.exp(-0.1) - 1 + 0.1], dtype=torch.float64))
    torch.testing.assert_close(logp.grad, torch.tensor([-5.0, 0.1], dtype=torch.float64))
