"""Schemas as code: a column list with documentation, turned into a pyarrow schema.

Every artifact kind (prompts, rollouts, scores, ...) declares its columns here with a doc string
(meaning, units, alignment). The pyarrow schema carries the docs as field metadata and the schema
name and version as schema metadata, so a Parquet shard describes itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

SCHEMA_NAME_KEY = b"rlpipe.schema"
SCHEMA_VERSION_KEY = b"rlpipe.schema_version"
DOC_KEY = b"doc"

# The element types every stage agrees on (docs/design.md#schemas): Polars reads them as List columns.
TOKEN_IDS = pa.list_(pa.int32())
LOGPROBS = pa.list_(pa.float32())


@dataclass(frozen=True)
class Column:
    """One documented column of an artifact schema."""

    name: str
    type: pa.DataType
    doc: str
    nullable: bool = False
    since: int = 1
    """The schema version that added the column: shards of an earlier version lack it, and a
    nullable one reads as null there (schemas/shards.py)."""

    def field(self) -> pa.Field:
        return pa.field(self.name, self.type, nullable=self.nullable, metadata={DOC_KEY: self.doc})


@dataclass(frozen=True)
class ColumnFamily:
    """A set of extra columns named `<prefix><name>` that all share one type.

    Used where the columns depend on configuration, e.g. one `reward__<component>` column per
    reward component in the scores artifact.
    """

    prefix: str
    type: pa.DataType
    doc: str

    def matches(self, name: str) -> bool:
        return name.startswith(self.prefix) and len(name) > len(self.prefix)

    def column(self, suffix: str, doc: str | None = None) -> Column:
        return Column(self.prefix + suffix, self.type, doc or self.doc, nullable=False)


@dataclass(frozen=True)
class ArtifactSchema:
    """The contract of one artifact kind: ordered columns, optional column families, a version."""

    name: str
    version: int
    doc: str
    columns: tuple[Column, ...]
    families: tuple[ColumnFamily, ...] = field(default_factory=tuple)
    #: Columns that identify a row (used to join artifacts and to order rows deterministically).
    key: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = [c.name for c in self.columns]
        if len(set(names)) != len(names):
            raise ValueError(f"schema {self.name!r} declares a column twice: {names}")
        for k in self.key:
            if k not in names:
                raise ValueError(f"schema {self.name!r}: key column {k!r} is not a column")

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    def column(self, name: str) -> Column:
        for c in self.columns:
            if c.name == name:
                return c
        for fam in self.families:
            if fam.matches(name):
                return fam.column(name[len(fam.prefix) :])
        raise KeyError(f"schema {self.name!r} has no column {name!r}")

    def arrow(self, extra: list[Column] | tuple[Column, ...] = ()) -> pa.Schema:
        """The pyarrow schema, with `extra` family columns appended in the given order."""
        for c in extra:
            if not any(f.matches(c.name) and f.type.equals(c.type) for f in self.families):
                raise ValueError(
                    f"schema {self.name!r}: extra column {c.name!r} ({c.type}) belongs to no "
                    f"column family; families: {[f.prefix + '*' for f in self.families]}"
                )
        fields = [c.field() for c in self.columns] + [c.field() for c in extra]
        return pa.schema(
            fields,
            metadata={SCHEMA_NAME_KEY: self.name.encode(), SCHEMA_VERSION_KEY: str(self.version).encode()},
        )

    def added_after(self, version: int) -> list[Column]:
        """The columns a shard written under `version` lacks (added by a later version)."""
        return [c for c in self.columns if c.since > version]

    def family_columns(self, names: list[str]) -> list[str]:
        """The names among `names` that belong to a column family of this schema."""
        return [n for n in names if any(f.matches(n) for f in self.families)]

    def describe(self) -> list[tuple[str, str, str, str]]:
        """Rows of (column, arrow type, nullable, doc) for display."""
        rows = [(c.name, str(c.type), "yes" if c.nullable else "no", c.doc) for c in self.columns]
        rows += [(f.prefix + "<name>", str(f.type), "no", f.doc) for f in self.families]
        return rows
