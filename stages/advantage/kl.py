"""KL estimators between the policy and the reference, per token (docs/algorithms.md#kl-estimators).

With lr = logp - ref_logp = log(pi / pi_ref):
    k1 = lr                          (unbiased, can be negative)
    k2 = 0.5 * lr^2                  (biased, low variance)
    k3 = exp(-lr) - 1 + lr           (= pi_ref/pi - log(pi_ref/pi) - 1; unbiased, always >= 0)
    abs = |lr|                       (biased, >= 0; a penalty on the size of the log-ratio)
    k3+ = k3 in value, k2 in gradient (straight-through: d k3+/d logp = lr)
See http://joschu.net/blog/kl-approx.html. The names are listed once, `KLEstimator` (config.py).

k3 (and k3+'s value) is clamped by default (as verl's `low_var_kl`): the log-ratio to
[-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND] = [-20, 20] before the exponential, the value to [0, K3_VALUE_BOUND] = [0, 10].
Unclamped, one token with lr = -40 contributes e^40 ~ 2e17 to the loss; clamped, at most 10 (and
no gradient through the clamped token, whose estimate is meaningless anyway). Inside the bounds
(|lr| < 20 and k3 < 10, i.e. about lr in (-2.4, 11.9)) the clamp changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


#: k3's clamp bounds: |log-ratio| <= 20 before exp, 0 <= k3 <= 10 after (verl's low_var_kl).
K3_LOG_RATIO_BOUND = 20.0
K3_VALUE_BOUND = 10.0


def k3(logp: torch.Tensor, ref_logp: torch.Tensor, *, clamp: bool = True) -> torch.Tensor:
    lr = logp - ref_logp
    if clamp:
        lr = lr.clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
        return (torch.exp(-lr) - 1 + lr).clamp(max=K3_VALUE_BOUND)
    return torch.exp(-lr) - 1 + lr


def abs_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return (logp - ref_logp).abs()


def k3_plus(logp: torch.Tensor, ref_logp: torch.Tensor, *, clamp: bool = True) -> torch.Tensor:
    """k3's value with k2's gradient (a straight-through estimator).

        value    = k2 + (k3 - k2) = k3                      (the detached term adds the difference)
        gradient = d k2 / d logp  = lr = logp - ref_logp

    k3's own gradient, 1 - exp(-lr), is the gradient of KL(pi_ref || pi) (the reverse direction)
    and grows exponentially for lr << 0; k2's gradient, lr, is that of KL(pi || pi_ref) to first
    order and linear in lr. k3+ keeps k3 as the logged, unbiased value while following k2's
    gradient (as verl's "low_var_kl+" / "k3+").
    """
    two = k2(logp, ref_logp)
    return two + (k3(logp, ref_logp, clamp=clamp) - two).detach()


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": k1, "k2": k2, "k3": k3, "abs": abs_kl, "k3+": k3_plus}


def kl(name: str, logp: torch.Tensor, ref_logp: torch.Tensor, *, clamp: bool = True) -> torch.Tensor:
    """Per-token KL estimate `name` (k1 | k2 | k3 | abs | k3+), same shape as the inputs; `clamp` bounds k3 and k3+'s value
    (see the module docstring; the others are never clamped)."""
    try:
        fn = KL_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown KL estimator {name!r}; known: {sorted(KL_ESTIMATORS)}") from None
    return fn(logp, ref_logp, clamp=clamp) if name in ("k3", "k3+") else fn(logp, ref_logp)


# ---------------------------------------------------------------------------------------------
# KL in the reward (PPO style) and the KL coefficient controller
# ---------------------------------------------------------------------------------------------
def kl_token_rewards(rewards: torch.Tensor, kl_t: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """Token rewards with the KL penalty in the reward (docs/algorithms.md#kl-placement, PPO style).

    Every response token gets `-beta * kl_t`; the last response token also gets the sequence
    reward R. Padding gets 0. The sum over a response is `R - beta * sum_t kl_t`, so with
    R = 0.8, sum_t kl_t = 0.05 and beta = 6 it is 0.5.
    See Ziegler et al. 2019, https://arxiv.org/abs/1909.08593, and Ouyang et al. 2022,
    https://arxiv.org/abs/2203.02155 (eq. 2).

    Args:
        rewards: sequence rewards R.
        kl_t: per-token KL estimates (k1 for the classic PPO reward), any value on padding.
        mask: 1.0 on real response tokens (a left-aligned prefix of each row), 0.0 on padding.
        beta: KL coefficient.

    Returns:
        The token rewards r_t.

    Shape:
        rewards: (B,); kl_t, mask and the result: (B, T).
    """
    mask = mask.to(kl_t.dtype)
    token_rewards = -beta * kl_t * mask  # r_t = -beta * kl_t on every real token
    return token_rewards + last_token_rewards(rewards.to(kl_t.dtype), mask)  # ... + R at t = T_b - 1


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) tensor holding R_b at the last real token of row b and 0 elsewhere (0 for empty rows).

    Shape:
        rewards: (B,); mask and the result: (B, T).
    """
    lengths = mask.sum(-1).long()
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    last = (lengths - 1).clamp(min=0).unsqueeze(-1)
    return out.scatter(1, last, (rewards * (lengths > 0)).unsqueeze(-1)) if mask.shape[1] else out


def fixed_kl_beta(beta: float, kl_value: float, *, target: float | None = None, n_steps: int = 0,
                  horizon: int = 10000) -> float:
    """A fixed KL coefficient (the default): returns `beta` unchanged."""
    return beta


def adaptive_kl_beta(beta: float, kl_value: float, *, target: float | None = None, n_steps: int = 0,
                     horizon: int = 10000) -> float:
    """One step of the adaptive KL controller of Ziegler et al. 2019 (https://arxiv.org/abs/1909.08593).

        e = clip(KL / KL_target - 1, -0.2, 0.2)
        beta <- beta * (1 + e * n_steps / horizon)

    Args:
        beta: current coefficient.
        kl_value: measured KL of the batch (mean over sequences of the summed per-token KL).
        target: KL_target (> 0).
        n_steps: samples (sequences) seen since the last update, usually the batch size.
        horizon: samples over which beta may change by a factor e.
    """
    if target is None or target <= 0:
        raise ValueError(f"adaptive KL controller needs a target KL > 0, got {target!r}")
    if horizon <= 0:
        raise ValueError(f"adaptive KL controller needs horizon > 0, got {horizon!r}")
    e = min(max(kl_value / target - 1.0, -0.2), 0.2)  # proportional error, clipped
    return beta * (1.0 + e * n_steps / horizon)


KL_CONTROLLERS: dict[str, Callable[..., float]] = {"fixed": fixed_kl_beta, "adaptive": adaptive_kl_beta}


def next_kl_beta(controller: str, beta: float, kl_value: float, **kwargs) -> float:
    """The KL coefficient for the next batch under controller `controller` (fixed | adaptive)."""
    try:
        fn = KL_CONTROLLERS[controller]
    except KeyError:
        raise ValueError(f"unknown KL controller {controller!r}; known: {sorted(KL_CONTROLLERS)}") from None
    return fn(beta, kl_value, **kwargs)
