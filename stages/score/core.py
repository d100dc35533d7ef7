"""The total reward: R = sum_k w_k * r_k (docs/algorithms.md#rewards)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def combine(weights: Sequence[float], components: Sequence[np.ndarray]) -> np.ndarray:
    """Weighted sum of reward components, accumulated in float64.

    Args:
        weights: w_k, one per component.
        components: r_k, each (N,).

    Returns:
        R = sum_k w_k * r_k, (N,) float64; a component with no value for a row (NaN: a TRL-style
        function's None) adds nothing to it, as TRL's nansum.
    """
    if len(weights) != len(components) or not components:
        raise ValueError(f"{len(weights)} weights for {len(components)} components")
    total = np.zeros_like(np.asarray(components[0], dtype=np.float64))
    for w, r in zip(weights, components, strict=True):
        r = np.asarray(r, dtype=np.float64)
        total += w * np.where(np.isnan(r), 0.0, r)  # R += w_k * r_k
    return total
