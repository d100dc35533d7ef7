"""Artifact IO: atomic Parquet shards, a manifest written last, validation on every read.

An artifact is a directory:
    part-00000.parquet, part-00001.parquet, ...   rows of one schema
    _manifest.json                                written last; the artifact exists iff it exists

Every file is written under a temporary name in the same directory and renamed into place, so a
reader never sees half a file, and a killed writer leaves nothing that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlpipe.schemas.columns import SCHEMA_NAME_KEY, ArtifactSchema, Column
from rlpipe.schemas.manifest import (
    MANIFEST_NAME,
    FileInfo,
    InputRef,
    Manifest,
    code_version,
    content_hash,
    library_versions,
)

if TYPE_CHECKING:
    import polars as pl
    import pyarrow.dataset as ds

SHARD_PREFIX = "part-"
SHARD_SUFFIX = ".parquet"
TMP_SUFFIX = ".tmp"


class ArtifactError(Exception):
    """Base class of artifact errors."""


class ArtifactNotFound(ArtifactError):
    """The directory has no manifest: the artifact is missing or was never completed."""


class SchemaMismatch(ArtifactError):
    """A shard does not match its expected schema; `problems` lists each difference."""

    def __init__(self, path: Path | str, expected: str, problems: Sequence[str]):
        self.path = Path(path)
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{self.path}: does not match schema {expected!r}:\n{lines}")


def shard_name(index: int) -> str:
    return f"{SHARD_PREFIX}{index:05d}{SHARD_SUFFIX}"


def _registry() -> Mapping[str, ArtifactSchema]:
    from rlpipe.schemas import SCHEMAS

    return SCHEMAS


def _resolve_schema(schema: ArtifactSchema | str) -> ArtifactSchema:
    if isinstance(schema, ArtifactSchema):
        return schema
    try:
        return _registry()[schema]
    except KeyError:
        raise ArtifactError(f"unknown schema {schema!r}; known: {sorted(_registry())}") from None


# ---------------------------------------------------------------------------------------------
# Atomic file writes
# ---------------------------------------------------------------------------------------------
def _tmp_path(path: Path) -> Path:
    # Hidden and pid-tagged: never matches part-*.parquet, and two writers never share one.
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


def atomic_write_bytes(path: Path, data: bytes | pa.Buffer, *, fsync: bool = False) -> None:
    """Write `data` to `path` via a temporary file and a rename (atomic on POSIX)."""
    tmp = _tmp_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Schema checks
# ---------------------------------------------------------------------------------------------
def _same_type(a: pa.DataType, b: pa.DataType) -> bool:
    """Type equality that ignores list item field names ('item' vs Parquet's 'element')."""
    if pa.types.is_list(a) or pa.types.is_large_list(a):
        return type(a) is type(b) and _same_type(a.value_type, b.value_type)
    if pa.types.is_struct(a):
        if not pa.types.is_struct(b) or a.num_fields != b.num_fields:
            return False
        return all(
            a.field(i).name == b.field(i).name and _same_type(a.field(i).type, b.field(i).type)
            for i in range(a.num_fields)
        )
    return a.equals(b)


def schema_problems(actual: pa.Schema, expected: ArtifactSchema) -> list[str]:
    """Column-by-column differences between a file's schema and the expected artifact schema."""
    problems: list[str] = []
    meta = actual.metadata or {}
    declared = meta.get(SCHEMA_NAME_KEY)
    if declared is not None and declared.decode() != expected.name:
        problems.append(f"file declares schema {declared.decode()!r}, expected {expected.name!r}")
    present = {f.name: f for f in actual}
    for col in expected.columns:
        if col.name not in present:
            problems.append(f"missing column {col.name!r} ({col.type})")
        elif not _same_type(present[col.name].type, col.type):
            problems.append(
                f"column {col.name!r}: type {present[col.name].type}, expected {col.type}"
            )
    declared_names = set(expected.column_names)
    for name, fld in present.items():
        if name in declared_names:
            continue
        family = next((f for f in expected.families if f.matches(name)), None)
        if family is None:
            problems.append(f"unexpected column {name!r} ({fld.type})")
        elif not _same_type(fld.type, family.type):
            problems.append(f"column {name!r}: type {fld.type}, expected {family.type}")
    return problems


def _null_problems(table: pa.Table, expected: ArtifactSchema) -> list[str]:
    problems = []
    for col in expected.columns:
        if not col.nullable and col.name in table.column_names:
            nulls = table.column(col.name).null_count
            if nulls:
                first = table.column(col.name).is_null().to_pylist().index(True)
                problems.append(
                    f"column {col.name!r} is not nullable but has {nulls} null(s), first at row {first}"
                )
    return problems


def check_file_schema(path: Path | str, expected: ArtifactSchema) -> pa.Schema:
    """The Arrow schema of a Parquet file, checked against `expected`; SchemaMismatch otherwise."""
    try:
        actual = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise SchemaMismatch(path, expected.name, [f"not a readable Parquet file ({e})"]) from None
    problems = schema_problems(actual, expected)
    if problems:
        raise SchemaMismatch(path, expected.name, problems)
    return actual


def read_shard(path: Path | str, schema: ArtifactSchema | str, columns: Sequence[str] | None = None) -> pa.Table:
    """Read one shard, validating its schema; raises SchemaMismatch naming the file and columns."""
    path = Path(path)
    expected = _resolve_schema(schema)
    check_file_schema(path, expected)
    table = pq.read_table(path, columns=list(columns) if columns is not None else None)
    problems = _null_problems(table, expected)
    if problems:
        raise SchemaMismatch(path, expected.name, problems)
    return _as_declared(table, expected)


def _as_declared(table: pa.Table, expected: ArtifactSchema) -> pa.Table:
    """Relabel a read table with the declared fields (Parquet names list items 'element', the
    schema 'item'; docs and schema metadata restored); a metadata-only cast, no data is copied."""
    target = pa.schema([expected.column(n).field() for n in table.column_names],
                       metadata=expected.arrow().metadata)
    return table if table.schema.equals(target, check_metadata=True) else table.cast(target)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
def conform(table: pa.Table | Mapping[str, Any], schema: pa.Schema, where: str) -> pa.Table:
    """Select and order the schema's columns and cast them; errors name the column."""
    if not isinstance(table, pa.Table):
        table = pa.table(dict(table))
    missing = [n for n in schema.names if n not in table.column_names]
    unexpected = [n for n in table.column_names if n not in schema.names]
    if missing or unexpected:
        raise ArtifactError(
            f"{where}: table does not fit the schema: missing columns {missing}, "
            f"unexpected columns {unexpected}"
        )
    arrays = []
    for fld in schema:
        col = table.column(fld.name)
        try:
            arrays.append(col.cast(fld.type) if not col.type.equals(fld.type) else col)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise ArtifactError(f"{where}: column {fld.name!r} cannot be cast from {col.type} to {fld.type}: {e}") from None
    return pa.Table.from_arrays(arrays, schema=schema)


class ArtifactWriter:
    """Writes one table artifact: shards first, each atomically, then the manifest.

    Usage:
        writer = ArtifactWriter(out_dir, ROLLOUTS, stage="rollout", config=cfg_dict, inputs=...)
        writer.write_shard(table, index=0)
        manifest = writer.commit()

    Opening a writer removes any manifest first (the artifact stops existing), then, with
    `clean=True`, every shard and temporary file a previous, possibly killed, run left behind.
    Workers that share one artifact directory open with `clean=False` and write disjoint shard
    indices; `commit()` (by one process, after all workers) lists every shard present.
    """

    def __init__(
        self,
        path: Path | str,
        schema: ArtifactSchema | str,
        *,
        stage: str,
        config: Mapping[str, Any] | None = None,
        inputs: Mapping[str, InputRef] | None = None,
        cache_key: str | None = None,
        extra_columns: Sequence[Column] = (),
        clean: bool = True,
        compression: str = "snappy",
    ):
        self.path = Path(path)
        self.schema = _resolve_schema(schema)
        self.arrow_schema = self.schema.arrow(extra_columns)
        self.stage = stage
        self.config = dict(config or {})
        self.inputs = dict(inputs or {})
        self.cache_key = cache_key
        self.compression = compression
        self._started = time.time()
        self._written: dict[str, FileInfo] = {}
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / MANIFEST_NAME).unlink(missing_ok=True)
        if clean:
            clear_directory(self.path)

    def write_shard(self, table: pa.Table | Mapping[str, Any], index: int) -> FileInfo:
        """Write `table` as shard number `index`, atomically; returns its file info."""
        name = shard_name(index)
        table = conform(table, self.arrow_schema, f"{self.path / name}")
        problems = _null_problems(table, self.schema)
        if problems:
            raise SchemaMismatch(self.path / name, self.schema.name, problems)
        # Straight into the hidden temporary file, hashed from the page cache, then renamed:
        # ~10% faster than encoding into a memory buffer first (benchmarks/bench_artifacts.py).
        final = self.path / name
        tmp = _tmp_path(final)
        try:
            pq.write_table(table, tmp, compression=self.compression)
            info = FileInfo(name=name, bytes=tmp.stat().st_size, sha256=_sha256_file(tmp), rows=table.num_rows)
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        self._written[name] = info
        return info

    def commit(self, extra: Mapping[str, Any] | None = None, wall_time_s: float | None = None) -> Manifest:
        """Write the manifest (last), listing every shard in the directory."""
        files = []
        for shard in sorted(self.path.glob(f"{SHARD_PREFIX}*{SHARD_SUFFIX}")):
            info = self._written.get(shard.name)
            if info is None:  # written by another worker: check and hash it here
                check_file_schema(shard, self.schema)
                rows = pq.ParquetFile(shard).metadata.num_rows
                info = FileInfo(name=shard.name, bytes=shard.stat().st_size, sha256=_sha256_file(shard), rows=rows)
            files.append(info)
        manifest = Manifest(
            kind="table",
            schema_name=self.schema.name,
            schema_version=self.schema.version,
            rows=sum(f.rows or 0 for f in files),
            files=files,
            content_hash=content_hash(files),
            stage=self.stage,
            config=self.config,
            inputs=self.inputs,
            cache_key=self.cache_key,
            extra=dict(extra or {}),
            wall_time_s=wall_time_s if wall_time_s is not None else time.time() - self._started,
            **_provenance(),
        )
        write_manifest(self.path, manifest)
        return manifest


    # -- N worker processes sharing one artifact directory ----------------------------------
    # Worker i writes its own disjoint shards, then drops a marker; the worker that then finds
    # every worker's marker (for this cache key) and every expected shard writes the manifest.
    # Two workers finishing at once may both commit: the manifests are identical but for the
    # timestamp, and each is written atomically.
    def _marker(self, index: int, count: int) -> Path:
        return self.path / f".worker-{index}-of-{count}.{(self.cache_key or 'nokey')[:16]}.done"

    def prepare_worker(self, index: int, count: int, others: Iterable[str]) -> None:
        """Before worker `index` of `count` writes: remove its old marker and every shard except
        `others` (the shards the other workers write), so all that is present at commit time
        was written for these inputs."""
        self._marker(index, count).unlink(missing_ok=True)
        keep = set(others)
        for p in self.path.glob(f"{SHARD_PREFIX}*{SHARD_SUFFIX}"):
            if p.name not in keep:
                p.unlink(missing_ok=True)

    def finish_worker(self, index: int, count: int, expected: Iterable[str], commit: Callable[[], Manifest],
                      extra: Mapping[str, Any] | None = None, wall_time_s: float | None = None) -> Manifest:
        """Mark worker `index` done. If every worker is done and every `expected` shard exists,
        run `commit()` (which writes the manifest) and remove the markers; otherwise return an
        in-memory manifest of this worker's own shards (`extra.partial = True`), not written."""
        self._marker(index, count).touch()
        markers = [self._marker(i, count) for i in range(count)]
        present = {p.name for p in self.path.glob(f"{SHARD_PREFIX}*{SHARD_SUFFIX}")}
        if all(m.exists() for m in markers) and present == set(expected):
            manifest = commit()
            for m in markers:
                m.unlink(missing_ok=True)
            return manifest
        files = sorted(self._written.values(), key=lambda f: f.name)
        return Manifest(
            kind="table", schema_name=self.schema.name, schema_version=self.schema.version,
            rows=sum(f.rows or 0 for f in files), files=files, content_hash=content_hash(files),
            stage=self.stage, config=self.config, inputs=self.inputs, cache_key=self.cache_key,
            extra={**(extra or {}), "partial": True, "worker_index": index, "worker_count": count},
            wall_time_s=wall_time_s if wall_time_s is not None else time.time() - self._started,
            **_provenance(),
        )


def _provenance() -> dict[str, Any]:
    return {
        "library_versions": library_versions(),
        "code_version": code_version(),
        "host": socket.gethostname(),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def clear_directory(path: Path) -> None:
    """Remove shards and temporary files (not the manifest: callers remove that first)."""
    for p in path.iterdir():
        if p.is_file() and (p.name.startswith(SHARD_PREFIX) or p.name.endswith(TMP_SUFFIX)):
            p.unlink()


def write_table_artifact(
    path: Path | str,
    schema: ArtifactSchema | str,
    table: pa.Table | Mapping[str, Any],
    *,
    stage: str,
    shard_by: str | None = None,
    rows_per_shard: int | None = None,
    extra: Mapping[str, Any] | None = None,
    wall_time_s: float | None = None,
    **writer_kwargs: Any,
) -> Manifest:
    """Write a whole table as an artifact in one call.

    Args:
        shard_by: a column whose equal values must stay in one shard (e.g. 'group_id').
        rows_per_shard: target shard size; shards end on a `shard_by` value boundary.
        extra: stage-specific summary recorded in the manifest.
        wall_time_s: the stage's wall time (default: the time this call took).
    """
    writer = ArtifactWriter(path, schema, stage=stage, **writer_kwargs)
    if not isinstance(table, pa.Table):
        table = conform(table, writer.arrow_schema, str(path))
    for i, part in enumerate(split_rows(table, shard_by, rows_per_shard)):
        writer.write_shard(part, index=i)
    return writer.commit(extra=extra, wall_time_s=wall_time_s)


def split_rows(table: pa.Table, shard_by: str | None, rows_per_shard: int | None) -> Iterator[pa.Table]:
    """Cut a table into consecutive slices of about `rows_per_shard` rows, never splitting a run
    of equal `shard_by` values (the rows of one group must be contiguous)."""
    n = table.num_rows
    if not rows_per_shard or n <= rows_per_shard:
        yield table
        return
    keys = table.column(shard_by).to_pylist() if shard_by else None
    start = 0
    while start < n:
        end = min(start + rows_per_shard, n)
        if keys is not None:
            while end < n and keys[end] == keys[end - 1]:
                end += 1
        yield table.slice(start, end - start)
        start = end


def write_manifest(path: Path | str, manifest: Manifest) -> None:
    data = json.dumps(manifest.model_dump(mode="json"), indent=2, sort_keys=False) + "\n"
    atomic_write_bytes(Path(path) / MANIFEST_NAME, data.encode(), fsync=True)


def commit_directory(
    path: Path | str,
    *,
    stage: str,
    config: Mapping[str, Any] | None = None,
    inputs: Mapping[str, InputRef] | None = None,
    cache_key: str | None = None,
    extra: Mapping[str, Any] | None = None,
    wall_time_s: float = 0.0,
) -> Manifest:
    """Write the manifest of a checkpoint directory (every file hashed); call after saving it."""
    path = Path(path)
    files = [
        FileInfo(name=str(p.relative_to(path)), bytes=p.stat().st_size, sha256=_sha256_file(p))
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME and not p.name.endswith(TMP_SUFFIX)
    ]
    manifest = Manifest(
        kind="checkpoint",
        files=files,
        content_hash=content_hash(files),
        stage=stage,
        config=dict(config or {}),
        inputs=dict(inputs or {}),
        cache_key=cache_key,
        extra=dict(extra or {}),
        wall_time_s=wall_time_s,
        **_provenance(),
    )
    write_manifest(path, manifest)
    return manifest


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------
def read_manifest(path: Path | str) -> Manifest:
    """The manifest of an artifact; ArtifactNotFound if there is none (missing or incomplete)."""
    path = Path(path)
    mpath = path / MANIFEST_NAME
    if not mpath.is_file():
        why = "does not exist" if not path.exists() else "has no _manifest.json (incomplete: its stage did not finish)"
        raise ArtifactNotFound(f"artifact {path} {why}")
    try:
        return Manifest.model_validate_json(mpath.read_bytes())
    except ValueError as e:
        raise ArtifactError(f"{mpath}: not a valid rlpipe manifest: {e}") from None


def exists(path: Path | str) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()


def cached_manifest(path: Path | str, key: str) -> Manifest | None:
    """The existing manifest at `path` if it was produced with cache key `key`, else None."""
    try:
        manifest = read_manifest(path)
    except ArtifactError:
        return None
    return manifest if manifest.cache_key == key else None


def _expect(manifest: Manifest, path: Path, schema: ArtifactSchema | str | None) -> ArtifactSchema:
    if manifest.kind != "table" or manifest.schema_name is None:
        raise ArtifactError(f"{path} is a {manifest.kind} artifact, not a table")
    expected = _resolve_schema(schema if schema is not None else manifest.schema_name)
    if manifest.schema_name != expected.name:
        raise SchemaMismatch(path / MANIFEST_NAME, expected.name,
                             [f"artifact holds {manifest.schema_name!r} rows, expected {expected.name!r}"])
    return expected


def shard_paths(path: Path | str) -> list[Path]:
    path = Path(path)
    return [path / name for name in read_manifest(path).shard_names]


def iter_shards(
    path: Path | str, schema: ArtifactSchema | str | None = None, columns: Sequence[str] | None = None
) -> Iterator[tuple[Path, pa.Table]]:
    """Yield (shard path, validated table) for each shard of a complete artifact, in order."""
    path = Path(path)
    manifest = read_manifest(path)
    expected = _expect(manifest, path, schema)
    for name in manifest.shard_names:
        yield path / name, read_shard(path / name, expected, columns)


def read_table_artifact(
    path: Path | str, schema: ArtifactSchema | str | None = None, columns: Sequence[str] | None = None
) -> pa.Table:
    """Read a whole table artifact (all shards, validated) into one Arrow table."""
    tables = [t for _, t in iter_shards(path, schema, columns)]
    if not tables:
        expected = _expect(read_manifest(path), Path(path), schema)
        names = list(columns) if columns else expected.column_names
        return expected.arrow().empty_table().select(names)
    return pa.concat_tables(tables, promote_options="none")


def validate_artifact(path: Path | str, schema: ArtifactSchema | str | None = None) -> list[str]:
    """Every problem with an artifact (manifest, files, hashes, schemas); empty when valid."""
    path = Path(path)
    try:
        manifest = read_manifest(path)
    except ArtifactError as e:
        return [str(e)]
    problems: list[str] = []
    listed = {f.name for f in manifest.files}
    for info in manifest.files:
        fpath = path / info.name
        if not fpath.is_file():
            problems.append(f"{fpath}: listed in the manifest but missing")
            continue
        if _sha256_file(fpath) != info.sha256:
            problems.append(f"{fpath}: content differs from the manifest's sha256 (modified after writing)")
    if manifest.content_hash != content_hash(manifest.files):
        problems.append(f"{path / MANIFEST_NAME}: content_hash does not match its file list")
    if manifest.kind == "table":
        stray = sorted(p.name for p in path.glob(f"{SHARD_PREFIX}*{SHARD_SUFFIX}") if p.name not in listed)
        if stray:
            problems.append(f"{path}: shards not listed in the manifest: {stray}")
        try:
            expected = _expect(manifest, path, schema)
        except ArtifactError as e:
            return problems + [str(e)]
        for name in manifest.shard_names:
            if (path / name).is_file():
                try:
                    t = read_shard(path / name, expected)
                except SchemaMismatch as e:
                    problems.append(str(e))
                    continue
                info = next(f for f in manifest.files if f.name == name)
                if t.num_rows != info.rows:
                    problems.append(f"{path / name}: {t.num_rows} rows, manifest says {info.rows}")
    return problems


# ---------------------------------------------------------------------------------------------
# Whole runs: runs/<run>/iter_NNNN/<artifact>/
# ---------------------------------------------------------------------------------------------
def run_artifacts(run_dir: Path | str, name: str) -> list[Path]:
    """Complete artifacts named `name` in every iteration of a run, in iteration order."""
    run_dir = Path(run_dir)
    iters = [d for d in run_dir.glob("iter_*") if d.name[5:].isdigit()]
    return [d / name for d in sorted(iters, key=lambda d: int(d.name[5:])) if exists(d / name)]


def _run_shards(
    run_dir: Path | str, name: str, schema: ArtifactSchema | str | None
) -> list[tuple[Path, list[str], pa.Schema | None]]:
    """(artifact, its shard paths, the schema of its first shard) per complete iteration artifact,
    every shard's schema checked."""
    out = []
    for art in run_artifacts(run_dir, name):
        manifest = read_manifest(art)
        expected = _expect(manifest, art, schema)
        files, first = [], None
        for shard in manifest.shard_names:
            actual = check_file_schema(art / shard, expected)
            files.append(str(art / shard))
            first = first if first is not None else actual
        out.append((art, files, first))
    if not out:
        raise ArtifactNotFound(f"no complete {name!r} artifact under {run_dir}/iter_*/")
    return out


def run_dataset(run_dir: Path | str, name: str, schema: ArtifactSchema | str | None = None) -> ds.Dataset:
    """All iterations' `name` artifacts as one pyarrow Dataset (schemas checked per shard)."""
    import pyarrow.dataset as ds

    files = [f for _, shards, _ in _run_shards(run_dir, name, schema) for f in shards]
    return ds.dataset(files, format="parquet")


def scan_run(
    run_dir: Path | str, name: str, schema: ArtifactSchema | str | None = None, *,
    iteration_column: str | None = None,
) -> pl.LazyFrame:
    """All iterations' `name` artifacts as one Polars LazyFrame (only complete artifacts).

    Args:
        iteration_column: if given, add a column of this name (Int32) holding the N of the
            `iter_NNNN` directory each row was read from.

    Iterations whose artifacts differ in their optional columns (e.g. other `reward__*`
    components) are concatenated diagonally: a column missing in one iteration reads as null.
    """
    import polars as pl

    found = _run_shards(run_dir, name, schema)
    parts = [(art, files, sch) for art, files, sch in found if files]
    if not parts:  # only empty artifacts: an empty frame of the declared schema
        expected = _expect(read_manifest(found[0][0]), found[0][0], schema)
        lf = pl.LazyFrame(schema=pl.from_arrow(expected.arrow().empty_table()).schema)
        return lf.with_columns(pl.lit(None, pl.Int32).alias(iteration_column)) if iteration_column else lf

    def scan(art: Path, files: list[str]) -> pl.LazyFrame:
        lf = pl.scan_parquet(files, glob=False)
        if iteration_column:
            lf = lf.with_columns(pl.lit(int(art.parent.name.split("_")[-1]), pl.Int32).alias(iteration_column))
        return lf

    first = parts[0][2]
    if not iteration_column and all(_same_schema(sch, first) for _, _, sch in parts):
        return pl.scan_parquet([f for _, files, _ in parts for f in files], glob=False)
    return pl.concat([scan(art, files) for art, files, _ in parts], how="diagonal_relaxed")


def _same_schema(a: pa.Schema | None, b: pa.Schema | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.names == b.names and all(_same_type(x.type, y.type) for x, y in zip(a, b, strict=True))


def scan_artifact(path: Path | str, schema: ArtifactSchema | str | None = None) -> pl.LazyFrame:
    """One complete artifact as a Polars LazyFrame (schemas checked per shard)."""
    import polars as pl

    path = Path(path)
    manifest = read_manifest(path)
    expected = _expect(manifest, path, schema)
    files = []
    for name in manifest.shard_names:
        check_file_schema(path / name, expected)
        files.append(str(path / name))
    if not files:
        return pl.LazyFrame(schema=pl.from_arrow(expected.arrow().empty_table()).schema)
    return pl.scan_parquet(files, glob=False)
