"""Arrow <-> tensor plumbing of the advantage and reference stages: joins by key, padding, lists.

Per-token list columns (`list<float32>`) become right-padded (B, T) tensors with a length mask,
and back. Joins are by the rollout key (iteration, group_id, sample_index), so inputs written by
different stages may list rows in any order.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from rlpipe.schemas import ROLLOUTS
from rlpipe.schemas.columns import LOGPROBS
from rlpipe.schemas.rollouts import response_masks

KEY = ROLLOUTS.key  # the join key is the schemas' (every per-rollout artifact declares the same one)


def key_tuples(table: pa.Table) -> list[tuple]:
    return list(zip(*(table.column(k).to_pylist() for k in KEY), strict=True))


def align(table: pa.Table, keys: pa.Table, *, source: Path | str) -> pa.Table:
    """Rows of `table` reordered to match the key order of `keys`; raises naming the first
    key that `table` (read from `source`) lacks or holds twice."""
    index: dict[tuple, int] = {}
    for i, k in enumerate(key_tuples(table)):
        if k in index:
            raise ValueError(f"{source}: key {dict(zip(KEY, k, strict=True))} appears twice")
        index[k] = i
    rows = []
    for k in key_tuples(keys):
        if k not in index:
            raise ValueError(f"{source}: no row for key {dict(zip(KEY, k, strict=True))}")
        rows.append(index[k])
    return table.take(pa.array(rows, type=pa.int64()))


def length_mask(lengths: torch.Tensor) -> torch.Tensor:
    """mask[b, t] = 1.0 for t < lengths[b], shape (B, max(lengths)) (float64)."""
    T = int(lengths.max()) if lengths.numel() else 0
    return (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).double()


def padded(column: pa.ChunkedArray | pa.Array, mask: torch.Tensor, *, what: str) -> torch.Tensor:
    """A list<float> column as a right-padded float64 (B, T) tensor (0 on padding).

    Raises if a row is null or its length differs from the mask's row length; `what` names the
    column and artifact in the message.
    """
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks else pa.array([], type=LOGPROBS)
    if column.null_count:
        first = column.is_null().to_pylist().index(True)
        raise ValueError(f"{what}: row {first} is null")
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    expected = mask.sum(-1).long().numpy()
    bad = np.nonzero(lengths != expected)[0]
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"{what}: row {b} has {lengths[b]} values, expected {expected[b]} (the response length)")
    out = torch.zeros(mask.shape, dtype=torch.float64)
    # Null elements are the tokens an environment wrote (response_logprobs of an episode): 0 here,
    # and masked out by every reader (`sampled_mask`).
    values = np.asarray(column.flatten().fill_null(0.0).to_numpy(zero_copy_only=False), dtype=np.float64)
    out[mask.bool()] = torch.from_numpy(values)  # row-major order of a prefix mask = flatten order
    return out


def sampled_mask(column: pa.ChunkedArray | pa.Array, mask: torch.Tensor, *, what: str) -> torch.Tensor | None:
    """`response_masks` as a (B, T) float64 tensor beside the length mask `mask` (0 on padding);
    None for single-turn rollouts."""
    rows = response_masks(column, mask.sum(-1).long().tolist(), what=what)
    if rows is None:
        return None
    out = torch.zeros(mask.shape, dtype=torch.float64)
    out[mask.bool()] = torch.tensor([v for m in rows for v in m], dtype=torch.float64)
    return out


def compact(x: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """The sampled entries of each row of x, left-aligned: (B, T) -> (B, max_b sum_t sampled[b, t]).

    An episode's environment tokens then do not exist for the math that follows (a KL sum, a GAE
    scan runs from one sampled token to the next); `expand` puts the results back in place.
    """
    width = int(sampled.sum(-1).max()) if sampled.numel() else 0
    out = x.new_zeros((x.shape[0], width))
    out[length_mask(sampled.sum(-1).long()).bool()] = x[sampled.bool()]
    return out


def expand(x: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """The inverse of `compact`: (B, T') -> (B, T), 0 where sampled is 0."""
    out = x.new_zeros(sampled.shape)
    out[sampled.bool()] = x[length_mask(sampled.sum(-1).long()).bool()]
    return out


def list_array(x: torch.Tensor, mask: torch.Tensor) -> pa.Array:
    """The masked entries of each row of a (B, T) tensor as a list<float32> array."""
    lengths = mask.sum(-1).long().numpy()
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = x.detach().cpu()[mask.bool().cpu()].to(torch.float32).numpy()
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.float32())).cast(LOGPROBS)


def list_array_from_numpy(arrays: Sequence[np.ndarray]) -> pa.Array:
    """Per-row float arrays as a list<float32> array (exact for float32 inputs)."""
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = np.concatenate(arrays).astype(np.float32) if arrays else np.zeros(0, np.float32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.float32())).cast(LOGPROBS)


def shard_index(path: Path) -> int:
    """The index of shard `part-00003.parquet` (3)."""
    return int(path.stem.split("-")[-1])
