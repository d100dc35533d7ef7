"""Atomic file writes: every file goes to a hidden, per-process temporary name in the same
directory and is renamed into place, so a reader never sees half a file and a killed writer leaves
nothing that looks complete (bytes, or a JSON object: the work orders of resident worker groups).
Also the SHA-256 of a file, as recorded in manifests."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa

from rlpipe.schemas.hashing import digest_file

TMP_SUFFIX = ".tmp"


def temp_path_for(path: Path) -> Path:
    """Where `path` is written before its rename: `.<name>.<pid>.tmp` beside it."""
    # Hidden and pid-tagged: never matches part-*.parquet, and two writers never share one.
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


def atomic_write_bytes(path: Path, data: bytes | pa.Buffer, *, fsync: bool = False) -> None:
    """Write `data` to `path` via a temporary file and a rename (atomic on POSIX). A failure
    (a full disk, a read-only mount) names `path`, not the temporary file, and removes that."""
    tmp = temp_path_for(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OSError(e.errno, e.strerror, str(path)) from e


def atomic_write_json(path: Path, data: Any) -> None:
    """Write `data` as JSON (keys sorted, on one line) to `path` atomically (`atomic_write_bytes`)."""
    atomic_write_bytes(path, json.dumps(data, sort_keys=True).encode())


def write_if_changed(path: Path, data: bytes) -> None:
    """Write `path` atomically, and only when its bytes change: a finished run's files (configs,
    the preset, the report) stay untouched on a rerun, so a run on a read-only mount reruns and a
    kill mid-write leaves the old file whole."""
    path = Path(path)
    if path.is_file() and path.read_bytes() == data:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, data)


def content_sha256(path: Path | str) -> str:
    """sha256 of a file's bytes, or of every file of a directory (relative path + bytes, sorted):
    the identity of data by content, whatever it is called or wherever it lies."""
    path = Path(path)
    if not path.is_dir():
        return digest_file(path, "sha256")
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f.relative_to(path).as_posix().encode() + b"\0" + digest_file(f, "sha256").encode())
    return h.hexdigest()
