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

from rlpipe.schemas.columns import ArtifactSchema
from rlpipe.schemas.errors import ArtifactNotFound
from rlpipe.schemas.reading import exists, read_manifest
from rlpipe.schemas.shards import verified_schema
from rlpipe.schemas.tables import scan_artifact, table_schema

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


def _run_shards(run_dir: Path | str, name: str, schema: ArtifactSchema | str | None) -> list[str]:
    """The shard paths of every complete iteration artifact `name`, each shard verified against
    its manifest and its schema checked."""
    found = _iteration_artifacts(run_dir, name)
    if not found:
        raise ArtifactNotFound(f"no complete {name!r} artifact under {run_dir}/{ITERATION_PREFIX}*/")
    files = []
    for _, art in found:
        manifest = read_manifest(art)
        expected = table_schema(manifest, art, schema)
        for info in manifest.files:
            if info.rows is not None:
                verified_schema(art / info.name, expected, info)
                files.append(str(art / info.name))
    return files


def run_dataset(run_dir: Path | str, name: str, schema: ArtifactSchema | str | None = None) -> ds.Dataset:
    """All iterations' `name` artifacts as one pyarrow Dataset. Its shards are verified and their
    schemas checked by this call, but the Dataset reads the files by name when it is scanned,
    unverified: an artifact rewritten in between is read as it is then (`scan_run` verifies
    what it reads)."""
    import pyarrow.dataset as ds

    return ds.dataset(_run_shards(run_dir, name, schema), format="parquet")


def scan_run(
    run_dir: Path | str, name: str, schema: ArtifactSchema | str | None = None, *,
    iteration_column: str | None = None,
) -> pl.LazyFrame:
    """All iterations' `name` artifacts as one Polars LazyFrame (only complete artifacts), each
    read as `scan_artifact` reads it: verified when scanned and when collected.

    Args:
        iteration_column: if given, add a column of this name (Int32) holding the k of the
            `iter_NNNN` directory each row was read from.

    Iterations whose artifacts differ in their optional columns (e.g. other `reward__*`
    components) are concatenated diagonally: a column missing in one iteration reads as null.
    """
    import polars as pl

    found = _iteration_artifacts(run_dir, name)
    if not found:
        raise ArtifactNotFound(f"no complete {name!r} artifact under {run_dir}/{ITERATION_PREFIX}*/")
    frames = [scan_artifact(art, schema) for _, art in found]
    if iteration_column:
        frames = [lf.with_columns(pl.lit(k, pl.Int32).alias(iteration_column))
                  for (k, _), lf in zip(found, frames, strict=True)]
    first = frames[0].collect_schema()
    if all(lf.collect_schema() == first for lf in frames):
        return pl.concat(frames, how="vertical")
    return pl.concat(frames, how="diagonal_relaxed")
