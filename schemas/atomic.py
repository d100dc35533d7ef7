"""Atomic file writes: every file goes to a hidden, per-process temporary name in the same
directory and is renamed into place, so a reader never sees half a file and a killed writer leaves
nothing that looks complete. Also the SHA-256 of a file, as recorded in manifests."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pyarrow as pa

TMP_SUFFIX = ".tmp"


def temp_path_for(path: Path) -> Path:
    """Where `path` is written before its rename: `.<name>.<pid>.tmp` beside it."""
    # Hidden and pid-tagged: never matches part-*.parquet, and two writers never share one.
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


def atomic_write_bytes(path: Path, data: bytes | pa.Buffer, *, fsync: bool = False) -> None:
    """Write `data` to `path` via a temporary file and a rename (atomic on POSIX)."""
    tmp = temp_path_for(path)
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
