"""Reading a user's data file into rows of Python values, with where each row came from.

Formats, by suffix: .jsonl / .ndjson / .json (JSON Lines; a .json file may also be one array of
objects), .csv / .tsv, .parquet / .pq; a directory is a Hugging Face `datasets` save
(`datasets.load_from_disk`), or else a folder of data files laid out as on the Hub (a dataset
repository's snapshot: `datasets.load_dataset(folder, data_files=...)` reads it, its splits named
by its files or its README's configs). Text that is not UTF-8 is read with surrogate escapes, so it can
be reported by column and row (`not_utf8`) instead of failing at the first bad byte.

Rows are numbered as the user would find them: JSON Lines and CSV by file line (from 1),
Parquet and `datasets` by row (from 0, as pyarrow, polars and pandas count).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlpipe.schemas.errors import DataError

JSONL = (".jsonl", ".ndjson", ".json")
CSV = (".csv", ".tsv")
PARQUET = (".parquet", ".pq")
#: Files `datasets.save_to_disk` writes (one Dataset, or a DatasetDict of splits).
DATASETS_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


class DataImportError(DataError):
    """A data file cannot be imported; the message names the file, the column and the rows."""


@dataclass(frozen=True)
class Source:
    """The rows of a data file, in file order."""

    path: Path
    format: str
    """'jsonl', 'csv', 'parquet' or 'datasets'."""
    columns: list[str]
    rows: list[dict[str, Any]]
    positions: list[int]
    """Where row i is in the file: its line (JSON Lines, CSV; from 1) or row (from 0)."""

    @property
    def unit(self) -> str:
        return "lines" if self.format in ("jsonl", "csv") else "rows"

    def where(self, indices: list[int]) -> str:
        """'lines 3, 9' / 'rows 0, 4 (counted from 0)' for row indices."""
        from rlpipe.schemas.prompts import rows_text

        base = "" if self.unit == "lines" else " (counted from 0)"
        unit = self.unit if len(indices) > 1 else self.unit[:-1]
        return f"{unit} {rows_text([self.positions[i] for i in indices])}{base}"


def is_data_file(path: Path | str) -> bool:
    """Whether `path` names data to import (a file of a known format, a `datasets` directory or a
    folder of data files) rather than an rlpipe artifact (a folder with a manifest). Decided by the
    suffix; a directory by its marker files or the data files in it."""
    path = Path(path)
    if path.suffix.lower() in (*JSONL, *CSV, *PARQUET):
        return True
    if not path.is_dir() or (path / "_manifest.json").exists():
        return False
    return any((path / m).is_file() for m in DATASETS_MARKERS) or any(
        f.suffix.lower() in (*JSONL, *CSV, *PARQUET) for f in path.rglob("*") if ".cache" not in f.parts)


def read_source(path: Path | str, split: str | None = None, data_files: str | list[str] | dict | None = None) -> Source:
    """Read `path` (see the module docstring); DataImportError for unreadable files."""
    path = Path(path)
    if not path.exists():
        raise DataImportError(f"{path} does not exist")
    suffix = path.suffix.lower()
    if path.is_dir() and (data_files is not None or not any((path / m).is_file() for m in DATASETS_MARKERS)):
        return _read_data_folder(path, split, data_files)
    if data_files is not None:
        raise DataImportError(f"{path} is not a folder of data files: drop data_files")
    if path.is_dir():
        return _read_datasets(path, split)
    if suffix in JSONL:
        return _read_jsonl(path)
    if suffix in CSV:
        return _read_csv(path, "\t" if suffix == ".tsv" else ",")
    if suffix in PARQUET:
        return _read_parquet(path)
    raise DataImportError(f"{path}: unknown format {suffix!r}; import .jsonl, .json, .csv, .tsv, .parquet "
                          "files or a directory saved with datasets' save_to_disk")


def not_utf8(value: Any) -> bool:
    """True for text holding surrogate escapes (bytes that were not UTF-8), at any depth."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(not_utf8(k) or not_utf8(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(not_utf8(v) for v in value)
    return False


def _read_jsonl(path: Path) -> Source:
    text = path.read_bytes().decode("utf-8", errors="surrogateescape")
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataImportError(f"{path}: not valid JSON at line {e.lineno}: {e.msg}") from None
        bad = [i for i, r in enumerate(data) if not isinstance(r, dict)]
        if bad:
            raise DataImportError(f"{path}: array items {bad[:10]} (counted from 0) are not JSON objects")
        # One array: positions are item indices, reported as rows.
        return Source(path, "json", _columns(data), data, list(range(len(data))))
    rows, lines, bad_json, not_objects = [], [], [], []
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            bad_json.append(f"{n} ({e.msg})")
            continue
        if not isinstance(row, dict):
            not_objects.append(str(n))
            continue
        rows.append(row)
        lines.append(n)
    if bad_json:
        raise DataImportError(f"{path}: not valid JSON at lines {', '.join(bad_json[:10])}: JSON Lines hold "
                              "one JSON object per line")
    if not_objects:
        raise DataImportError(f"{path}: lines {', '.join(not_objects[:10])} are not JSON objects "
                              "({\"prompt\": ..., ...})")
    return Source(path, "jsonl", _columns(rows), rows, lines)


def _read_csv(path: Path, delimiter: str) -> Source:
    text = path.read_bytes().decode("utf-8-sig", errors="surrogateescape")
    reader = csv.DictReader(text.splitlines(keepends=True), delimiter=delimiter)
    rows, lines, start = [], [], 2
    try:
        for row in reader:
            if None in row:  # more fields than the header names
                raise DataImportError(f"{path}: line {start} has {len(reader.fieldnames or []) + len(row[None])} "
                                      f"fields, the header names {len(reader.fieldnames or [])}")
            rows.append(dict(row))
            lines.append(start)
            start = reader.line_num + 1
    except csv.Error as e:
        raise DataImportError(f"{path}: line {reader.line_num}: {e}") from None
    return Source(path, "csv", list(reader.fieldnames or []), rows, lines)


def _read_parquet(path: Path) -> Source:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataImportError(f"{path}: not a readable Parquet file ({e})") from None
    return _from_arrow(path, "parquet", table)


def _read_data_folder(path: Path, split: str | None, data_files: str | list[str] | dict | None) -> Source:
    """A folder of data files as `datasets.load_dataset` reads a Hub dataset's repository."""
    datasets = _datasets(path)
    try:
        ds = datasets.load_dataset(str(path), data_files=data_files)
    except (FileNotFoundError, ValueError) as e:  # (no data files, a pattern matching none, mixed formats)
        raise DataImportError(f"{path}: `datasets` finds no data to read ({type(e).__name__}: "
                              f"{(str(e).splitlines() or [''])[0][:300]}): name its files with data_files=PATTERN") from None
    return _from_arrow(path, "datasets", _one_split(path, ds, split).with_format("arrow")[:])


def _datasets(path: Path):
    try:
        import datasets
    except ImportError:
        raise DataImportError(f"{path}: reading it needs the `datasets` package (pip install 'rlpipe[data]')") from None
    return datasets


def _one_split(path: Path, ds, split: str | None):
    """The split asked for of a DatasetDict: the only one, else 'train' when there is one."""
    if split is None:
        split = next(iter(ds)) if len(ds) == 1 else "train" if "train" in ds else None
    if split not in ds:
        raise DataImportError(f"{path} holds the splits {sorted(ds)}: choose one with split=NAME (--split NAME)")
    return ds[split]


def _read_datasets(path: Path, split: str | None) -> Source:
    if not any((path / m).is_file() for m in DATASETS_MARKERS):
        raise DataImportError(f"{path} is a directory but not a `datasets` save (no {' / '.join(DATASETS_MARKERS)}); "
                              "import a .jsonl, .csv or .parquet file, or a directory written by save_to_disk")
    datasets = _datasets(path)
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        ds = _one_split(path, ds, split)
    elif split is not None:
        raise DataImportError(f"{path} is a single dataset with no splits; drop split={split!r}")
    return _from_arrow(path, "datasets", ds.with_format("arrow")[:])


def _from_arrow(path: Path, fmt: str, table: Any) -> Source:
    """Rows of an Arrow table; string columns that are not valid UTF-8 become surrogate-escaped
    text (found later by `not_utf8`), binary columns are decoded as text the same way."""
    import pyarrow as pa

    columns = {}
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            try:
                col.validate(full=True)
            except pa.ArrowInvalid:
                col = col.cast(pa.binary() if pa.types.is_string(col.type) else pa.large_binary())
        values = col.to_pylist()
        if pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type):
            values = [v.decode("utf-8", errors="surrogateescape") if v is not None else None for v in values]
        columns[name] = values
    n = table.num_rows
    rows = [{name: values[i] for name, values in columns.items()} for i in range(n)]
    return Source(path, fmt, list(table.column_names), rows, list(range(n)))


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    """Every key of any row, in order of first appearance."""
    seen: dict[str, None] = {}
    for r in rows:
        seen.update(dict.fromkeys(r))
    return list(seen)
