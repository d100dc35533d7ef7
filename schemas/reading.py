"""Reading one artifact: its manifest (an artifact exists iff `_manifest.json` does), its shards
as Arrow tables or a Polars LazyFrame (every shard's schema checked first), and
`validate_artifact`, which lists everything wrong with it (files, hashes, schemas, row counts)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from rlpipe.schemas.atomic import sha256_file
from rlpipe.schemas.columns import ArtifactSchema
from rlpipe.schemas.errors import ArtifactError, ArtifactNotFound, SchemaMismatch
from rlpipe.schemas.manifest import MANIFEST_NAME, FileInfo, Manifest, content_hash
from rlpipe.schemas.shards import (
    SHARD_GLOB,
    check_file_schema,
    missing_nullable,
    read_shard,
    resolve_schema,
)
from rlpipe.schemas.verify import check_manifest_hash, verify_file

if TYPE_CHECKING:
    import polars as pl


def read_manifest(path: Path | str) -> Manifest:
    """The manifest of an artifact; ArtifactNotFound if there is none (missing or incomplete),
    IntegrityError if its content hash is not that of its file list."""
    path = Path(path)
    mpath = path / MANIFEST_NAME
    if not mpath.is_file():
        raise _not_found(path)
    try:
        manifest = Manifest.model_validate_json(mpath.read_bytes())
    except ValueError as e:
        raise ArtifactError(f"{mpath}: not a valid rlpipe manifest: {e}") from None
    check_manifest_hash(manifest, path)
    return manifest


def _not_found(path: Path) -> ArtifactNotFound:
    from rlpipe.schemas.pruning import pruned, pruned_error

    record = pruned(path)
    if record is not None:
        return pruned_error(path, record)
    why = "does not exist" if not path.exists() else "has no _manifest.json (incomplete: its stage did not finish)"
    return ArtifactNotFound(f"artifact {path} {why}")


def exists(path: Path | str) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()


def cached_manifest(path: Path | str, key: str) -> Manifest | None:
    """The existing manifest at `path` if it was produced with cache key `key`, else None. An
    artifact pruned after it was produced with that key counts (its recorded manifest): the work
    was done (`rlpipe.schemas.pruning`)."""
    from rlpipe.schemas.pruning import recorded_manifest

    try:
        manifest = recorded_manifest(path)
    except ArtifactError:
        return None
    return manifest if manifest.cache_key == key else None


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
        return [str(_not_found(path))]
    except ValueError as e:
        return [f"{path / MANIFEST_NAME}: not a valid rlpipe manifest: {e}"]
    problems: list[str] = []
    listed = {f.name for f in manifest.files}
    # The files as they are: the schema checks below read them unverified (each difference from
    # the manifest is listed here instead of stopping the check).
    actual: dict[str, FileInfo] = {}
    for info in manifest.files:
        fpath = path / info.name
        if not fpath.is_file():
            problems.append(f"{fpath}: listed in the manifest but missing")
            continue
        actual[info.name] = FileInfo(name=info.name, bytes=fpath.stat().st_size, sha256=sha256_file(fpath))
        if actual[info.name].sha256 != info.sha256:
            problems.append(f"{fpath}: content differs from the manifest's sha256 (modified after writing)")
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
    """One complete artifact as a Polars LazyFrame (schemas checked per shard)."""
    import polars as pl

    path = Path(path)
    manifest = read_manifest(path)
    expected = table_schema(manifest, path, schema)
    frames = []
    for info in manifest.files:
        if info.rows is not None:
            verify_file(path / info.name, info)
            actual = check_file_schema(path / info.name, expected)
            frame = pl.scan_parquet(str(path / info.name), glob=False)
            # a shard of an earlier schema version: the nullable columns added since, as null
            added = missing_nullable(actual.names, expected)
            if added:
                empty = pl.from_arrow(pa.schema([c.field() for c in added]).empty_table()).schema
                frame = frame.with_columns(pl.lit(None, dtype=t).alias(n) for n, t in empty.items())
                frame = frame.select([c for c in expected.column_names if c in actual.names or c in empty]
                                     + [n for n in actual.names if n not in expected.column_names])
            frames.append(frame)
    if not frames:
        return pl.LazyFrame(schema=pl.from_arrow(expected.arrow().empty_table()).schema)
    return pl.concat(frames, how="vertical") if len(frames) > 1 else frames[0]
