"""Reading the optimisation batch: advantages joined with rollouts (and reference log-probs).

The batch is the advantages' rows: a `filter` stage may have dropped groups before the advantage
stage, which also writes no row for a greedy baseline response, so the rollouts (and reference)
may hold more rows; the rows the advantages name are read from them by the join key
(iteration, group_id, sample_index). Rows are sorted by that key, so every rank sees the same rows
in the same order and the seeded schedule picks the same rows on any world size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rlpipe.schemas import ADVANTAGES, REFERENCE, ROLLOUTS, read_table_artifact
from rlpipe.schemas.rollouts import response_masks, sampled_lengths

KEY = ROLLOUTS.key  # the join key is the schemas' (every per-rollout artifact declares the same one)
#: What optimize reads of the rollouts besides the key (not the texts: decoding them costs).
_ROLLOUT_COLUMNS = ("prompt_token_ids", "response_token_ids", "response_logprobs", "finish_reason", "response_mask")


@dataclass
class Batch:
    """All rows of one optimisation batch, in key order. Per-token lists have length T_i."""

    keys: list[tuple[int, int, int]]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rollout_logp: list[np.ndarray]
    advantages: list[np.ndarray]
    returns: list[np.ndarray] | None
    values: list[np.ndarray] | None
    ref_logp: list[np.ndarray] | None
    reward: np.ndarray
    group_id: np.ndarray
    truncated: np.ndarray
    sampled_counts: np.ndarray
    """Per row, the tokens the model sampled (`rlpipe.schemas.rollouts.sampled_lengths`), (N,) int64."""
    sampled: list[np.ndarray] | None = None
    """Episodes: per token 1.0 where the model sampled it, 0.0 where the environment wrote it (the
    rollouts' response_mask); None when every token was sampled. Only sampled tokens are trained."""

    @property
    def iteration(self) -> int:
        return int(self.keys[0][0]) if self.keys else 0

    def __len__(self) -> int:
        return len(self.keys)

    def lengths(self, rows: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """Tokens per response (an episode's environment tokens included)."""
        rows = range(len(self)) if rows is None else rows
        return np.array([len(self.response_ids[i]) for i in rows], dtype=np.int64)

    def sequence_lengths(self) -> np.ndarray:
        """Tokens per row, prompt and response: what a forward pass takes."""
        return np.array([len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids, strict=True)],
                        dtype=np.int64)

    def sampled_lengths(self, rows: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """Tokens per response the model sampled: those the loss counts."""
        return self.sampled_counts if rows is None else self.sampled_counts[np.asarray(rows, dtype=np.int64)]

    def sampled_rows(self, rows: Sequence[int] | np.ndarray) -> list[np.ndarray] | None:
        return None if self.sampled is None else [self.sampled[i] for i in rows]


def _keys(table) -> list[tuple[int, int, int]]:
    cols = [table.column(k).to_pylist() for k in KEY]
    return list(zip(*cols, strict=False))


def _floats(column, name: str, path: Path, keys, lengths) -> list[np.ndarray]:
    """Per-token floats; null elements (an episode's environment tokens in response_logprobs) are 0."""
    out = []
    for i, x in enumerate(column.to_pylist()):
        arr = np.asarray([0.0 if v is None else v for v in x], dtype=np.float32)
        if len(arr) != lengths[i]:
            raise ValueError(
                f"{path}: row {keys[i]} column {name!r} has {len(arr)} values but the response has "
                f"{lengths[i]} tokens"
            )
        out.append(arr)
    return out


def _align(path: Path, keys: list, want: list, advantages: Path) -> list[int]:
    """Row indices of `keys` (another artifact's rows) in the order of `want` (the advantages'
    rows); rows of `keys` that the advantages do not name are left out."""
    where = {k: i for i, k in enumerate(keys)}
    if len(where) != len(keys):
        raise ValueError(f"{path}: duplicate keys {KEY}")
    missing = [k for k in want if k not in where]
    if missing:
        raise ValueError(
            f"{path}: {len(missing)} rows of the advantages {advantages} are missing on {KEY} (first "
            f"{missing[:3]}): give the artifacts the advantages were computed from"
        )
    return [where[k] for k in want]


def load_batch(rollouts: Path, advantages: Path, reference: Path | None = None, *,
               need_ref: bool = False, need_values: bool = False) -> Batch:
    """The advantages' rows joined with their rollouts (and reference) rows, sorted by key.

    Raises:
        ValueError: naming the artifact, row and column, when an advantages row has no rollouts
            (or reference) row, a per-token list has the wrong length, or a needed column (ref
            log-probs, values, returns) is null.
    """
    ro = read_table_artifact(rollouts, ROLLOUTS, columns=[*KEY, *_ROLLOUT_COLUMNS])
    adv = read_table_artifact(advantages, ADVANTAGES)
    adv = adv.take(np.lexsort([np.asarray(adv.column(k)) for k in reversed(KEY)]))
    keys = _keys(adv)
    if len(set(keys)) != len(keys):
        raise ValueError(f"{advantages}: duplicate keys {KEY}")
    ro = ro.take(_align(rollouts, _keys(ro), keys, advantages))
    response_ids = ro.column("response_token_ids").to_pylist()
    lengths = [len(r) for r in response_ids]

    def per_token(table, name: str, path: Path, required: bool) -> list[np.ndarray] | None:
        col = table.column(name)
        if col.null_count == len(col) and not required:
            return None
        if col.null_count:
            first = col.is_null().to_pylist().index(True)
            raise ValueError(f"{path}: column {name!r} is null at row {keys[first]} ({col.null_count} nulls)")
        return _floats(col, name, path, keys, lengths)

    ref = None
    if reference is not None:
        rt = read_table_artifact(reference, REFERENCE)
        rt = rt.take(_align(reference, _keys(rt), keys, advantages))
        ref = per_token(rt, "ref_logprobs", reference, need_ref)
    if ref is None:
        ref = per_token(adv, "ref_logprobs", advantages, need_ref)
    return Batch(
        keys=keys,
        prompt_ids=ro.column("prompt_token_ids").to_pylist(),
        response_ids=response_ids,
        rollout_logp=_floats(ro.column("response_logprobs"), "response_logprobs", rollouts, keys, lengths),
        advantages=_floats(adv.column("token_advantages"), "token_advantages", advantages, keys, lengths),
        returns=per_token(adv, "returns", advantages, need_values),
        values=per_token(adv, "values", advantages, need_values),
        ref_logp=ref,
        reward=np.asarray(adv.column("reward"), dtype=np.float64),
        group_id=np.asarray(ro.column("group_id")),
        truncated=np.asarray(ro.column("finish_reason").to_pylist()) == "length",
        sampled_counts=np.array(sampled_lengths(ro.column("response_mask"), lengths, what=f"{rollouts}: column "
                                                "'response_mask'"), dtype=np.int64),
        sampled=_sampled(ro.column("response_mask"), rollouts, keys, lengths),
    )


def _sampled(column, path: Path, keys, lengths) -> list[np.ndarray] | None:
    """The rollouts' response_mask as float arrays (`response_masks`); None for single-turn rollouts."""
    rows = response_masks(column, lengths, what=f"{path}: column 'response_mask'")
    return None if rows is None else [np.asarray(m, dtype=np.float32) for m in rows]


def pad_rows(arrays: Sequence[np.ndarray], rows: Sequence[int] | np.ndarray, width: int) -> torch.Tensor:
    """Stack the per-token arrays of `rows`, left-aligned and zero-padded to `width`: (B, width)."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for b, i in enumerate(rows):
        a = arrays[i]
        out[b, : len(a)] = torch.from_numpy(a)
    return out
