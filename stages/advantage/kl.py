"""KL estimators between the policy and the reference, per token (ALGORITHMS.md section 4).

With lr = logp - ref_logp = log(pi / pi_ref):
    k1 = lr                          (unbiased, can be negative)
    k2 = 0.5 * lr^2                  (biased, low variance)
    k3 = exp(-lr) - 1 + lr           (= pi_ref/pi - log(pi_ref/pi) - 1; unbiased, always >= 0)
See http://joschu.net/blog/kl-approx.html.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3"]


def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    lr = logp - ref_logp
    return torch.exp(-lr) - 1 + lr


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"k1": k1, "k2": k2, "k3": k3}


def kl(name: str, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL estimate `name` (k1 | k2 | k3), same shape as the inputs."""
    try:
        return KL_ESTIMATORS[name](logp, ref_logp)
    except KeyError:
        raise ValueError(f"unknown KL estimator {name!r}; known: {sorted(KL_ESTIMATORS)}") from None
