"""Pure helpers of the reward-model stage: the held-out split and the batch order."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np


def split_pairs(pair_ids: Sequence[str], eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic train/held-out split of preference pairs.

    Pairs are ranked by sha256(seed, pair_id) and the first round(eval_fraction * n) are held out
    (at least one when eval_fraction > 0 and n >= 2), so the split depends only on the pair ids
    and the seed, never on row order or sharding.

    Returns:
        (train_idx, eval_idx): row indices into `pair_ids`, each sorted ascending.
    """
    n = len(pair_ids)
    if len(set(pair_ids)) != n:
        seen: set[str] = set()
        dup = next(p for p in pair_ids if p in seen or seen.add(p))  # type: ignore[func-returns-value]
        raise ValueError(f"pair_id {dup!r} occurs more than once; pair ids must be unique")
    n_eval = int(round(eval_fraction * n))
    if eval_fraction > 0 and n >= 2:
        n_eval = min(max(n_eval, 1), n - 1)
    keys = [hashlib.sha256(f"{seed}\0{p}".encode()).hexdigest() for p in pair_ids]
    order = sorted(range(n), key=keys.__getitem__)
    eval_idx = np.sort(np.array(order[:n_eval], dtype=np.int64))
    train_idx = np.sort(np.array(order[n_eval:], dtype=np.int64))
    return train_idx, eval_idx


def epoch_batches(n: int, batch_size: int, epoch: int, seed: int, rank: int = 0,
                  world_size: int = 1) -> list[np.ndarray]:
    """This rank's micro-batches for one epoch: a seeded shuffle cut into global batches of
    `batch_size * world_size`, each split into `world_size` slices (rank r takes slice r).

    The last incomplete global batch is dropped when world_size > 1 (every rank must take the same
    number of steps); with one rank it is kept.
    """
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    step = batch_size * world_size
    batches = []
    for start in range(0, n, step):
        chunk = perm[start : start + step]
        if len(chunk) < step and world_size > 1:
            break
        batches.append(chunk[rank * batch_size : (rank + 1) * batch_size])
    return batches


def chance_band(n_pairs: int) -> float:
    """Half-width of the held-out accuracies a reward model that knows nothing reaches.

    With no signal each held-out pair is a fair coin (r_c > r_r with probability 1/2), so the
    accuracy over n pairs has mean 1/2 and standard deviation sqrt(1/4 / n) = 1 / (2 sqrt(n)); two
    standard deviations, 1 / sqrt(n), cover ~95% of such runs (0.105 on 90 pairs, 0.071 on 200).
    """
    return 1.0 / math.sqrt(n_pairs)


def near_chance(accuracy: float, n_pairs: int) -> bool:
    """True when the held-out accuracy is not clearly better than chance: below 1/2 + chance_band
    (a model ranking worse than a coin counts too)."""
    return bool(accuracy < 0.5 + chance_band(n_pairs))
