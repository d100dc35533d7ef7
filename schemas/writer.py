"""Writing artifacts: table artifacts (ArtifactWriter, write_table_artifact), the protocol by
which N worker processes share one artifact directory (prepare_worker / finish_worker), and the
manifest of a checkpoint directory (commit_directory).

An artifact is a directory:
    part-00000.parquet, part-00001.parquet, ...   rows of one schema
    _manifest.json                                written last; the artifact exists iff it exists

Shards and the manifest are written atomically (rlpipe.schemas.atomic) into a staging directory
beside the artifact (rlpipe.schemas.staging); the manifest comes last, then the staging directory
is swapped into place. Until then the previous artifact at that path, if any, is untouched.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlpipe.schemas.atomic import TMP_SUFFIX, atomic_write_bytes, temp_path_for
from rlpipe.schemas.columns import ArtifactSchema, Column
from rlpipe.schemas.errors import ArtifactError, SchemaMismatch
from rlpipe.schemas.hashing import HashingWriter, digest_file
from rlpipe.schemas.manifest import (
    MANIFEST_NAME,
    FileInfo,
    InputRef,
    Manifest,
    code_version,
    content_hash,
    library_versions,
)
from rlpipe.schemas.shards import (
    SHARD_GLOB,
    check_file_schema,
    null_problems,
    resolve_schema,
    shard_name,
)
from rlpipe.schemas.staging import open_staging, staging_path, swap_into_place
from rlpipe.schemas.table_memory import TABLES

#: The done markers of the workers sharing an artifact (`ArtifactWriter.finish_worker`).
_MARKERS = ".worker-*.done"


def conform(table: pa.Table | Mapping[str, Any], schema: pa.Schema, where: str) -> pa.Table:
    """Select and order the schema's columns and cast them; errors name the column. A nullable
    column left out is written as nulls (e.g. the episode columns of single-turn rollouts)."""
    if not isinstance(table, pa.Table):
        table = pa.table(dict(table))
    for fld in schema:
        if fld.nullable and fld.name not in table.column_names:
            table = table.append_column(fld.name, pa.nulls(table.num_rows, fld.type))
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
    """Writes one table artifact: shards first, each atomically, then the manifest, all in a
    staging directory (`staging`) that `commit()` swaps into place at `path`.

    Usage:
        writer = ArtifactWriter(out_dir, ROLLOUTS, stage="rollout", config=cfg_dict, inputs=...)
        writer.write_shard(table, index=0)
        manifest = writer.commit()

    Opening a writer leaves the artifact at `path` as it is (complete or not) until commit. With
    `clean=True` (one process) it writes into a fresh private staging directory. Workers that
    share one artifact open with `clean=False`: they write disjoint shard indices into one shared
    staging directory, and `commit()` (by the last worker) lists every shard present there.
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
        self.schema = resolve_schema(schema)
        self.arrow_schema = self.schema.arrow(extra_columns)
        self.stage = stage
        self.config = dict(config or {})
        self.inputs = dict(inputs or {})
        self.cache_key = cache_key
        self.compression = compression
        self._started = time.time()
        self._written: dict[str, FileInfo] = {}
        self.staging = open_staging(self.path, shared=not clean, fresh=clean)
        """Where shards go until `commit()` (read the stage's own shards from here)."""

    def write_shard(self, table: pa.Table | Mapping[str, Any], index: int) -> FileInfo:
        """Write `table` as shard number `index`, atomically; returns its file info."""
        name = shard_name(index)
        table = conform(table, self.arrow_schema, f"{self.path / name}")
        problems = null_problems(table, self.schema)
        if problems:
            raise SchemaMismatch(self.path / name, self.schema.name, problems)
        # Straight into the hidden temporary file, hashed on the way (no second read), then
        # renamed (benchmarks/bench_artifacts.py).
        final = self.staging / name
        tmp = temp_path_for(final)
        try:
            with open(tmp, "wb") as f:
                out = HashingWriter(f)
                pq.write_table(table, out, compression=self.compression)
            info = FileInfo.of(name, out.size, out.hexdigest(), out.algorithm, rows=table.num_rows)
            os.replace(tmp, final)
            TABLES.remember(info.tagged_digest, table)  # (a read in this process decodes nothing)
        except OSError as e:  # disk full, read-only: Arrow's message does not name the file
            raise ArtifactError(f"{self.path / name}: cannot write the shard ({e}); nothing was "
                                "replaced: free space or choose another output") from None
        finally:
            tmp.unlink(missing_ok=True)
        self._written[name] = info
        return info

    def written(self, name: str) -> FileInfo | None:
        """The file info of shard `name` if this writer wrote it (else None: another worker's)."""
        return self._written.get(name)

    def commit(self, extra: Mapping[str, Any] | None = None, wall_time_s: float | None = None) -> Manifest:
        """Write the manifest (last), listing every shard in the staging directory, and swap the
        staging directory into place (sub-directories of the old `path` are kept: nested
        artifacts a stage wrote inside its output before committing it)."""
        for marker in self.staging.glob(_MARKERS):
            marker.unlink(missing_ok=True)
        files = []
        for shard in sorted(self.staging.glob(SHARD_GLOB)):
            info = self._written.get(shard.name)
            if info is None:  # written by another worker: check and hash it here
                check_file_schema(shard, self.schema)
                rows = pq.ParquetFile(shard).metadata.num_rows
                info = FileInfo.of(shard.name, shard.stat().st_size, digest_file(shard), rows=rows)
            files.append(info)
        manifest = self._manifest(files, extra, wall_time_s)
        write_manifest(self.staging, manifest)
        swap_into_place(self.staging, self.path, keep_subdirs=True)
        return manifest

    def _manifest(self, files: list[FileInfo], extra: Mapping[str, Any] | None,
                  wall_time_s: float | None) -> Manifest:
        """The table manifest of `files` (not written)."""
        return Manifest(
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

    # -- N worker processes sharing one artifact directory ----------------------------------
    # Worker i writes its own disjoint shards into the shared staging directory, then, holding
    # the artifact's commit lock, drops a marker; the worker that then finds every worker's marker
    # (for this cache key) and every expected shard writes the manifest and swaps the staging
    # directory in. The lock makes that exactly one worker.
    def _marker(self, index: int, count: int) -> Path:
        return self.staging / f".worker-{index}-of-{count}.{(self.cache_key or 'nokey')[:16]}.done"  # (matches _MARKERS)

    def prepare_worker(self, index: int, count: int, others: Iterable[str]) -> None:
        """Before worker `index` of `count` writes: remove its old marker and every shard except
        `others` (the shards the other workers write), so all that is present at commit time
        was written for these inputs. Under the commit lock: a sibling that finished meanwhile
        and committed (on an earlier run's marker of this worker) swapped the staging directory
        away, so it is made again."""
        with _commit_lock(self.path):
            self.staging.mkdir(parents=True, exist_ok=True)
            self._marker(index, count).unlink(missing_ok=True)
        keep = set(others)
        for p in self.staging.glob(SHARD_GLOB):
            if p.name not in keep:
                p.unlink(missing_ok=True)

    def finish_worker(self, index: int, count: int, expected: Iterable[str], commit: Callable[[], Manifest],
                      extra: Mapping[str, Any] | None = None, wall_time_s: float | None = None) -> Manifest:
        """Mark worker `index` done. If every worker is done and every `expected` shard exists,
        run `commit()` (which writes the manifest) and remove the markers; otherwise return an
        in-memory manifest of this worker's own shards (`extra.partial = True`), not written."""
        with _commit_lock(self.path):
            self._marker(index, count).touch()
            markers = [self._marker(i, count) for i in range(count)]
            present = {p.name for p in self.staging.glob(SHARD_GLOB)}
            if all(m.exists() for m in markers) and present == set(expected):
                return commit()  # removes the markers, then swaps the staging directory in
        files = sorted(self._written.values(), key=lambda f: f.name)
        partial = {**(extra or {}), "partial": True, "worker_index": index, "worker_count": count}
        return self._manifest(files, partial, wall_time_s)


def forget_finished_workers(path: Path | str) -> None:
    """Remove the done markers earlier runs' workers left beside the shards of `path` (in its
    shared staging directory). A launch that starts every worker of a group calls this first, so
    that only its own workers' markers count: otherwise the first of them to finish could commit
    on a sibling's marker from an attempt that failed, and swap the staging directory away while
    that sibling, started but slower, still writes into it. (Workers run one at a time by hand
    keep their siblings' markers: that is how a group finishes across separate runs.)"""
    for marker in staging_path(path, shared=True).glob(_MARKERS):
        marker.unlink(missing_ok=True)


@contextlib.contextmanager
def _commit_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on `.<name>.lock` beside the artifact (released when the process dies)."""
    lock = path.with_name(f".{path.name}.lock")
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _provenance() -> dict[str, Any]:
    return {
        "library_versions": library_versions(),
        "code_version": code_version(),
        "host": socket.gethostname(),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


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
    try:
        atomic_write_bytes(Path(path) / MANIFEST_NAME, data.encode(), fsync=True)
    except OSError as e:
        raise ArtifactError(f"{Path(path) / MANIFEST_NAME}: cannot write the manifest ({e})") from None


def commit_directory(path: Path | str, **manifest_fields: Any) -> Manifest:
    """Write the manifest of a checkpoint directory (every file hashed); call after saving it,
    inside `rlpipe.schemas.staging.staged_directory` so the old checkpoint stays whole until then.
    The keyword arguments are `checkpoint_manifest`'s."""
    manifest = checkpoint_manifest(path, **manifest_fields)
    write_manifest(path, manifest)
    return manifest


def checkpoint_manifest(
    path: Path | str,
    *,
    stage: str,
    config: Mapping[str, Any] | None = None,
    inputs: Mapping[str, InputRef] | None = None,
    cache_key: str | None = None,
    extra: Mapping[str, Any] | None = None,
    wall_time_s: float = 0.0,
    known: Mapping[str, FileInfo] | None = None,
) -> Manifest:
    """The manifest of the checkpoint directory `path`: every file in it, hashed, plus the files
    `known` describes by the bytes they will hold (written later, in the background: handoff.py)."""
    path = Path(path)
    known = dict(known or {})
    files = [
        FileInfo.of(str(p.relative_to(path)), p.stat().st_size, digest_file(p))
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME and not p.name.endswith(TMP_SUFFIX)
        and str(p.relative_to(path)) not in known
    ]
    files = sorted([*files, *known.values()], key=lambda f: f.name)
    return Manifest(
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
