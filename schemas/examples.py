"""Synthetic rows of any artifact schema: for tests, benchmarks and trying the CLI.

`example_table(ROLLOUTS, 8)` is a valid rollouts table (every column filled, list columns of
matching lengths, groups of `group_size` contiguous rows), reproducible from `seed`.
Pure Python + pyarrow (no numpy), so keep it to small tables.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from rlpipe.schemas.columns import ArtifactSchema, Column

# Columns whose values follow a row's structure rather than its type.
_ALIGNED = ("response_token_ids", "response_logprobs", "token_advantages", "returns", "values",
            "ref_logprobs", "kl")


def _value(rng: random.Random, t: pa.DataType, length: int) -> Any:
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return [_value(rng, t.value_type, length) for _ in range(length)]
    if pa.types.is_struct(t):
        return {t.field(i).name: _value(rng, t.field(i).type, length) for i in range(t.num_fields)}
    if pa.types.is_integer(t):
        return rng.randrange(0, 320)
    if pa.types.is_floating(t):
        return round(rng.uniform(-3.0, 0.0), 4)
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "".join(rng.choice("abcdefgh 0123456789+=") for _ in range(rng.randrange(1, 24)))
    if pa.types.is_boolean(t):
        return rng.random() < 0.5
    raise TypeError(f"no example values for type {t}")


def example_table(
    schema: ArtifactSchema, rows: int, *, seed: int = 0, group_size: int = 4, iteration: int = 0,
    extra: Sequence[Column] = (), max_len: int = 12,
) -> pa.Table:
    """`rows` synthetic rows of `schema` (plus `extra` family columns), valid for an ArtifactWriter."""
    rng = random.Random(seed)
    lengths = [rng.randrange(1, max_len + 1) for _ in range(rows)]
    data: dict[str, list[Any]] = {}
    for col in (*schema.columns, *extra):
        name = col.name
        if name == "iteration":
            values = [iteration] * rows
        elif name == "group_id":
            values = [i // group_size for i in range(rows)]
        elif name == "sample_index":
            values = [i % group_size for i in range(rows)]
        elif name in ("prompt_id", "pair_id"):
            values = [f"p{i // group_size:05d}" if "group_id" in schema.column_names else f"p{i:05d}"
                      for i in range(rows)]
        elif name == "finish_reason":
            values = [rng.choice(["stop", "stop", "length"]) for _ in range(rows)]
        elif name == "response_length":
            values = lengths
        elif name == "response_mask":  # who wrote each token: 1 the model, 0 an environment
            values = [[int(rng.random() < 0.75) for _ in range(n)] for n in lengths]
        elif name in _ALIGNED:
            values = [_value(rng, col.type, n) for n in lengths]
        else:
            values = [_value(rng, col.type, rng.randrange(1, max_len + 1)) for _ in range(rows)]
        if col.nullable:  # every third row null, to exercise validity bitmaps
            values = [None if i % 3 == 2 else v for i, v in enumerate(values)]
        data[name] = values
    return pa.table(data, schema=schema.arrow(tuple(extra)))
