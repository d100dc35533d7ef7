"""One Parquet shard of a table artifact: its name (`part-NNNNN.parquet`), the check of its schema
against an ArtifactSchema (a column-by-column diff, then non-null columns), and reading it back
with the declared fields. Every read of a shard, anywhere, goes through these checks."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlpipe.schemas.columns import SCHEMA_NAME_KEY, SCHEMA_VERSION_KEY, ArtifactSchema, Column
from rlpipe.schemas.errors import ArtifactError, IntegrityError, SchemaMismatch, SchemaVersionError
from rlpipe.schemas.manifest import FileInfo
from rlpipe.schemas.registry import SCHEMAS
from rlpipe.schemas.table_memory import TABLES
from rlpipe.schemas.verify import listed_entry, open_verified

SHARD_PREFIX = "part-"
SHARD_SUFFIX = ".parquet"
SHARD_GLOB = f"{SHARD_PREFIX}*{SHARD_SUFFIX}"


def shard_name(index: int) -> str:
    return f"{SHARD_PREFIX}{index:05d}{SHARD_SUFFIX}"


def resolve_schema(schema: ArtifactSchema | str) -> ArtifactSchema:
    """The schema itself, or the registered schema of that name; ArtifactError if unknown."""
    if isinstance(schema, ArtifactSchema):
        return schema
    try:
        return SCHEMAS[schema]
    except KeyError:
        raise ArtifactError(f"unknown schema {schema!r}; known: {sorted(SCHEMAS)}") from None


def same_type(a: pa.DataType, b: pa.DataType) -> bool:
    """Type equality that ignores list item field names ('item' vs Parquet's 'element')."""
    if pa.types.is_list(a) or pa.types.is_large_list(a):
        return type(a) is type(b) and same_type(a.value_type, b.value_type)
    if pa.types.is_struct(a):
        if not pa.types.is_struct(b) or a.num_fields != b.num_fields:
            return False
        return all(
            a.field(i).name == b.field(i).name and same_type(a.field(i).type, b.field(i).type)
            for i in range(a.num_fields)
        )
    return a.equals(b)


def same_schema(a: pa.Schema | None, b: pa.Schema | None) -> bool:
    """Same column names in the same order with the same types (as `same_type`)."""
    if a is None or b is None:
        return a is b
    return a.names == b.names and all(same_type(x.type, y.type) for x, y in zip(a, b, strict=True))


def file_version(actual: pa.Schema, expected: ArtifactSchema) -> int:
    """The schema version a file declares (files without one: the expected version)."""
    declared = (actual.metadata or {}).get(SCHEMA_VERSION_KEY)
    try:
        return int(declared) if declared is not None else expected.version
    except ValueError:
        return expected.version


def schema_problems(actual: pa.Schema, expected: ArtifactSchema) -> list[str]:
    """Column-by-column differences between a file's schema and the expected artifact schema.

    A file written under an earlier version of the schema may lack the columns added since: a
    nullable one is read as null (`read_shard`, `scan_artifact`), a required one is a problem
    (`SchemaVersionError`). A file of a later version than this rlpipe knows is refused."""
    problems: list[str] = []
    meta = actual.metadata or {}
    declared = meta.get(SCHEMA_NAME_KEY)
    if declared is not None and declared.decode() != expected.name:
        problems.append(f"file declares schema {declared.decode()!r}, expected {expected.name!r}")
    version = file_version(actual, expected)
    present = {f.name: f for f in actual}
    readable_as_null = {c.name for c in expected.added_after(version) if c.nullable}
    for col in expected.columns:
        if col.name not in present and col.name in readable_as_null:
            continue
        if col.name not in present:
            problems.append(f"missing column {col.name!r} ({col.type})")
        elif not same_type(present[col.name].type, col.type):
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
        elif not same_type(fld.type, family.type):
            problems.append(f"column {name!r}: type {fld.type}, expected {family.type}")
    return problems


def null_problems(table: pa.Table, expected: ArtifactSchema) -> list[str]:
    """A line per non-nullable column that holds nulls, naming the count and the first row."""
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


def check_file_schema(path: Path | str, expected: ArtifactSchema, source: pa.NativeFile | None = None) -> pa.Schema:
    """The Arrow schema of a Parquet file (read from `source`, the file opened, when given, else
    from `path`), checked against `expected`; SchemaMismatch otherwise (SchemaVersionError when
    the file is of another version of the schema than this rlpipe can read)."""
    try:
        actual = pq.read_schema(source if source is not None else path)
    except (pa.ArrowInvalid, OSError) as e:
        raise SchemaMismatch(path, expected.name, [f"not a readable Parquet file ({e})"]) from None
    return check_schema(path, actual, expected)


def check_schema(path: Path | str, actual: pa.Schema, expected: ArtifactSchema) -> pa.Schema:
    """`actual`, the Arrow schema of the Parquet file `path`, checked against `expected`
    (SchemaMismatch, or SchemaVersionError for another version of the schema)."""
    problems = schema_problems(actual, expected)
    if problems:
        version = file_version(actual, expected)
        if version != expected.version:
            raise SchemaVersionError(path, expected, version, problems)
        raise SchemaMismatch(path, expected.name, problems)
    return actual


def verified_schema(path: Path | str, expected: ArtifactSchema, info: FileInfo | None) -> pa.Schema:
    """The schema of a shard whose bytes are verified against its manifest entry `info`
    (`open_verified`), checked against `expected` (`check_file_schema`)."""
    with open_verified(path, info) as source:
        return check_file_schema(path, expected, source=source)


def missing_nullable(actual_names: Sequence[str], expected: ArtifactSchema) -> list[Column]:
    """The nullable columns of `expected` a table of an earlier schema version lacks."""
    return [c for c in expected.columns if c.nullable and c.name not in actual_names]


#: A listed shard up to this size is decoded whole and kept (`TABLES`) even when a read asks for
#: some of its columns: its decode costs about as much either way (the footer and each column's
#: set-up), and the stages and the driver's summary read different columns of the same shards.
DECODE_WHOLE_BYTES = 8 << 20


def read_shard(path: Path | str, schema: ArtifactSchema | str, columns: Sequence[str] | None = None,
               info: FileInfo | None = None) -> pa.Table:
    """Read one shard, verified and validated: its bytes against the hash (and rows) its
    manifest lists (`info`, default: looked up in the manifest beside it; a directory without a
    manifest, such as a stage's own staging directory, has nothing to verify against), then its
    schema. The file is opened once and the rows decoded are those of the bytes verified
    (`open_verified`), whatever is renamed over `path` meanwhile. IntegrityError or SchemaMismatch
    name the file."""
    path = Path(path)
    expected = resolve_schema(schema)
    info = info if info is not None else listed_entry(path)
    names = list(columns) if columns is not None else None
    with open_verified(path, info) as source:
        written = TABLES.get(info.tagged_digest) if info is not None else None
        if written is not None:  # (verified bytes this process encoded or decoded before: table_memory.py)
            actual = check_schema(path, written.schema, expected)
            present = _present(names, actual)
            table = written if present is None else written.select(present)
        else:
            try:  # (one parse of the footer for the schema and the rows: ~1/3 faster than read_table)
                parquet = pq.ParquetFile(source)
            except (pa.ArrowInvalid, OSError) as e:
                raise SchemaMismatch(path, expected.name, [f"not a readable Parquet file ({e})"]) from None
            actual = check_schema(path, parquet.schema_arrow, expected)
            if info is not None and (names is None or info.bytes <= DECODE_WHOLE_BYTES):
                # every column, kept: the next read of these verified bytes decodes nothing
                table = parquet.read()
                TABLES.remember(info.tagged_digest, table)
                present = _present(names, actual)
                table = table if present is None else table.select(present)
            else:
                table = parquet.read(columns=_present(names, actual))
    if info is not None and info.rows is not None and table.num_rows != info.rows:
        raise IntegrityError(f"{path}: {table.num_rows} rows, its manifest says {info.rows}")
    problems = null_problems(table, expected)
    if problems:
        raise SchemaMismatch(path, expected.name, problems)
    for col in missing_nullable(table.column_names, expected):  # (an earlier version: read as null)
        if names is None or col.name in names:
            table = table.append_column(col.field(), pa.nulls(table.num_rows, col.type))
    if names is not None:
        table = table.select(names)
    return _as_declared(table, expected)


def _present(names: list[str] | None, actual: pa.Schema) -> list[str] | None:
    """The requested columns the file has (one of an earlier version may lack some)."""
    return None if names is None else [n for n in names if n in actual.names]


def _as_declared(table: pa.Table, expected: ArtifactSchema) -> pa.Table:
    """Relabel a read table with the declared fields (Parquet names list items 'element', the
    schema 'item'; docs and schema metadata restored); a metadata-only cast, no data is copied."""
    target = pa.schema([expected.column(n).field() for n in table.column_names],
                       metadata=expected.arrow().metadata)
    return table if table.schema.equals(target, check_metadata=True) else table.cast(target)
