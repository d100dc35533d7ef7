"""A run directory's iterations: the one definition of their names (`iter_NNNN`, and `eval_0000`
for the evaluation before the first iteration), and reading one artifact across all of them
(`run_artifacts`, `run_dataset`, `scan_run`).

    runs/<run>/iter_0000/<artifact>/, runs/<run>/iter_0001/<artifact>/, ...

The full layout of a run (data/, models/, report/) is pipelines.layout.RunLayout, built on these.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from rlpipe.schemas.columns import ArtifactSchema
from rlpipe.schemas.errors import ArtifactNotFound
from rlpipe.schemas.reading import exists, read_manifest, table_schema
from rlpipe.schemas.shards import check_file_schema, same_schema
from rlpipe.schemas.verify import verify_file

if TYPE_CHECKING:
    import polars as pl
    import pyarrow.dataset as ds

ITERATION_PREFIX = "iter_"
INITIAL_EVAL_DIR = "eval_0000"
"""Evaluation of the starting policy, before iteration 0 (a sibling of the iteration dirs)."""

_ITERATION_NAME = re.compile(rf"{ITERATION_PREFIX}([0-9]{{4,}})")


def iteration_dir_name(k: int) -> str:
    """The directory of iteration `k` (from 0): `iter_0003`; more digits past 9999."""
    if k < 0:
        raise ValueError(f"iteration must be >= 0, got {k}")
    return f"{ITERATION_PREFIX}{k:04d}"


def iteration_index(name: str) -> int | None:
    """k for a name `iteration_dir_name(k)` returns, None for any other name (so `iter_3`,
    `iter_00003` and `iter_x` are not iterations)."""
    m = _ITERATION_NAME.fullmatch(name)
    if m is None:
        return None
    k = int(m[1])
    return k if iteration_dir_name(k) == name else None


def iteration_dirs(run_dir: Path | str) -> list[tuple[int, Path]]:
    """(k, directory) of every iteration directory of a run, in iteration order."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(k, d) for d in run_dir.iterdir() if (k := iteration_index(d.name)) is not None and d.is_dir()]
    return sorted(found)


def _iteration_artifacts(run_dir: Path | str, name: str) -> list[tuple[int, Path]]:
    return [(k, d / name) for k, d in iteration_dirs(run_dir) if exists(d / name)]


def run_artifacts(run_dir: Path | str, name: str) -> list[Path]:
    """Complete artifacts named `name` in every iteration of a run, in iteration order."""
    return [art for _, art in _iteration_artifacts(run_dir, name)]


def _run_shards(
    run_dir: Path | str, name: str, schema: ArtifactSchema | str | None
) -> list[tuple[int, Path, list[str], pa.Schema | None]]:
    """(iteration, artifact, its shard paths, the schema of its first shard) per complete
    iteration artifact, every shard verified against its manifest and its schema checked."""
    out = []
    for k, art in _iteration_artifacts(run_dir, name):
        manifest = read_manifest(art)
        expected = table_schema(manifest, art, schema)
        files, first = [], None
        for info in manifest.files:
            if info.rows is None:
                continue
            verify_file(art / info.name, info)
            actual = check_file_schema(art / info.name, expected)
            files.append(str(art / info.name))
            first = first if first is not None else actual
        out.append((k, art, files, first))
    if not out:
        raise ArtifactNotFound(f"no complete {name!r} artifact under {run_dir}/{ITERATION_PREFIX}*/")
    return out


def run_dataset(run_dir: Path | str, name: str, schema: ArtifactSchema | str | None = None) -> ds.Dataset:
    """All iterations' `name` artifacts as one pyarrow Dataset (schemas checked per shard)."""
    import pyarrow.dataset as ds

    files = [f for _, _, shards, _ in _run_shards(run_dir, name, schema) for f in shards]
    return ds.dataset(files, format="parquet")


def scan_run(
    run_dir: Path | str, name: str, schema: ArtifactSchema | str | None = None, *,
    iteration_column: str | None = None,
) -> pl.LazyFrame:
    """All iterations' `name` artifacts as one Polars LazyFrame (only complete artifacts).

    Args:
        iteration_column: if given, add a column of this name (Int32) holding the k of the
            `iter_NNNN` directory each row was read from.

    Iterations whose artifacts differ in their optional columns (e.g. other `reward__*`
    components) are concatenated diagonally: a column missing in one iteration reads as null.
    """
    import polars as pl

    found = _run_shards(run_dir, name, schema)
    parts = [(k, files, sch) for k, _, files, sch in found if files]
    if not parts:  # only empty artifacts: an empty frame of the declared schema
        art = found[0][1]
        expected = table_schema(read_manifest(art), art, schema)
        lf = pl.LazyFrame(schema=pl.from_arrow(expected.arrow().empty_table()).schema)
        return lf.with_columns(pl.lit(None, pl.Int32).alias(iteration_column)) if iteration_column else lf

    def scan(k: int, files: list[str]) -> pl.LazyFrame:
        lf = pl.scan_parquet(files, glob=False)
        if iteration_column:
            lf = lf.with_columns(pl.lit(k, pl.Int32).alias(iteration_column))
        return lf

    first = parts[0][2]
    if not iteration_column and all(same_schema(sch, first) for _, _, sch in parts):
        return pl.scan_parquet([f for _, files, _ in parts for f in files], glob=False)
    return pl.concat([scan(k, files) for k, files, _ in parts], how="diagonal_relaxed")
