"""Reading a table artifact: its shards as Arrow tables (`iter_shards`, `read_table_artifact`) or
a Polars LazyFrame (`scan_artifact`), every shard verified against the artifact's manifest and
its schema checked, and `validate_artifact`, which lists everything wrong with it (files, hashes,
schemas, row counts). Built on the manifest (rlpipe.schemas.reading) and on one shard's checks
(rlpipe.schemas.shards)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from rlpipe.schemas.columns import ArtifactSchema
from rlpipe.schemas.errors import ArtifactError, SchemaMismatch
from rlpipe.schemas.hashing import digest_file
from rlpipe.schemas.manifest import MANIFEST_NAME, FileInfo, Manifest, content_hash
from rlpipe.schemas.reading import not_found_error, read_manifest
from rlpipe.schemas.shards import SHARD_GLOB, read_shard, resolve_schema, verified_schema

if TYPE_CHECKING:
    import polars as pl


def table_schema(manifest: Manifest, path: Path, schema: ArtifactSchema | str | None) -> ArtifactSchema:
    """The schema the shards of the table artifact at `path` must have: `schema` when given (it
    must be the one the manifest names), else the manifest's. ArtifactError for a checkpoint."""
    if manifest.kind != "table" or manifest.schema_name is None:
        raise ArtifactError(f"{path} is a {manifest.kind} artifact, not a table")
    expected = resolve_schema(schema if schema is not None else manifest.schema_name)
    if manifest.schema_name != expected.name:
        raise SchemaMismatch(path / MANIFEST_NAME, expected.name,
                             [f"artifact holds {manifest.schema_name!r} rows, expected {expected.name!r}"])
    return expected


def iter_shards(
    path: Path | str, schema: ArtifactSchema | str | None = None, columns: Sequence[str] | None = None
) -> Iterator[tuple[Path, pa.Table]]:
    """Yield (shard path, verified and validated table) for each shard of a complete artifact."""
    path = Path(path)
    manifest = read_manifest(path)
    expected = table_schema(manifest, path, schema)
    for info in manifest.files:
        if info.rows is not None:
            yield path / info.name, read_shard(path / info.name, expected, columns, info)


def read_table_artifact(
    path: Path | str, schema: ArtifactSchema | str | None = None, columns: Sequence[str] | None = None
) -> pa.Table:
    """Read a whole table artifact (all shards, validated) into one Arrow table."""
    tables = [t for _, t in iter_shards(path, schema, columns)]
    if not tables:
        expected = table_schema(read_manifest(path), Path(path), schema)
        names = list(columns) if columns else expected.column_names
        return expected.arrow().empty_table().select(names)
    return pa.concat_tables(tables, promote_options="none")


def validate_artifact(path: Path | str, schema: ArtifactSchema | str | None = None) -> list[str]:
    """Every problem with an artifact (manifest, files, hashes, schemas); empty when valid."""
    path = Path(path)
    try:
        manifest = Manifest.model_validate_json((path / MANIFEST_NAME).read_bytes())
    except FileNotFoundError:
        return [str(not_found_error(path))]
    except ValueError as e:
        return [f"{path / MANIFEST_NAME}: not a valid rlpipe manifest: {e}"]
    problems: list[str] = []
    listed = {f.name for f in manifest.files}
    # The files as they are: the schema checks below read them unverified (each difference from
    # the manifest is listed here instead of stopping the check).
    actual: dict[str, FileInfo] = {}
    for info in manifest.files:
        fpath = path / info.name
        if info.name in manifest.not_written:  # (a record of weights held in memory only)
            if fpath.exists():
                problems.append(f"{fpath}: the manifest says it was never written, yet it is there")
            continue
        if not fpath.is_file():
            problems.append(f"{fpath}: listed in the manifest but missing")
            continue
        actual[info.name] = FileInfo.of(info.name, fpath.stat().st_size, digest_file(fpath, info.algorithm),
                                        info.algorithm)
        if actual[info.name].digest != info.digest:
            problems.append(f"{fpath}: content differs from the manifest's {info.algorithm} (modified after writing)")
    if manifest.content_hash != content_hash(manifest.files):
        problems.append(f"{path / MANIFEST_NAME}: content_hash does not match its file list")
    if manifest.kind == "table":
        stray = sorted(p.name for p in path.glob(SHARD_GLOB) if p.name not in listed)
        if stray:
            problems.append(f"{path}: shards not listed in the manifest: {stray}")
        try:
            expected = table_schema(manifest, path, schema)
        except ArtifactError as e:
            return problems + [str(e)]
        for name in manifest.shard_names:
            if (path / name).is_file():
                try:
                    t = read_shard(path / name, expected, info=actual[name])
                except SchemaMismatch as e:
                    problems.append(str(e))
                    continue
                info = next(f for f in manifest.files if f.name == name)
                if t.num_rows != info.rows:
                    problems.append(f"{path / name}: {t.num_rows} rows, manifest says {info.rows}")
    return problems


def scan_artifact(path: Path | str, schema: ArtifactSchema | str | None = None) -> pl.LazyFrame:
    """One complete artifact as a Polars LazyFrame, verified twice: every shard's bytes and
    schema here (a bad shard fails this call), and again as the frame is collected, by
    `read_shard` against the manifest read here. So a collect returns the rows of that version of
    the artifact or fails with IntegrityError (it was rewritten since: scan it again), never the
    rows of another. Shards are read one at a time (only the columns a query needs); a shard of an
    earlier schema version has the nullable columns added since as null."""
    import polars as pl
    from polars.io.plugins import register_io_source

    path = Path(path)
    manifest = read_manifest(path)
    expected = table_schema(manifest, path, schema)
    shards = [info for info in manifest.files if info.rows is not None]
    names = _frame_columns(path, expected, shards)
    frame_schema = pl.from_arrow(pa.schema([expected.column(n).field() for n in names]).empty_table()).schema
    if not shards:
        return pl.LazyFrame(schema=frame_schema)

    def batches(with_columns: list[str] | None, predicate: pl.Expr | None, n_rows: int | None,
                _batch_size: int | None) -> Iterator[pl.DataFrame]:
        left = n_rows
        for info in shards:
            if left is not None and left <= 0:
                return
            frame = pl.from_arrow(read_shard(path / info.name, expected, names if with_columns is None else with_columns, info))
            if left is not None:  # the first n_rows rows of the artifact, before any filter
                frame = frame.head(left)
                left -= frame.height
            # (a source must apply the filter Polars pushes down to it)
            yield frame if predicate is None else frame.filter(predicate)

    return register_io_source(batches, schema=frame_schema)


def _frame_columns(path: Path, expected: ArtifactSchema, shards: list[FileInfo]) -> list[str]:
    """The columns of an artifact's frame: the declared ones, then the family columns
    (`reward__*`) its shards have, which must be the same in every shard (each shard verified
    and its schema checked)."""
    extras: list[str] | None = None
    for info in shards:
        actual = verified_schema(path / info.name, expected, info)
        mine = expected.family_columns(actual.names)
        if extras is not None and mine != extras:
            raise SchemaMismatch(path / info.name, expected.name,
                                 [f"family columns {mine}, the artifact's first shard has {extras}"])
        extras = mine
    return [*expected.column_names, *(extras or [])]
