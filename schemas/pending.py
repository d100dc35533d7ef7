"""Artifacts whose content is decided while their files are still being written, in this process.

The local runner hands optimize's new policy to the next rollout in memory and writes its
checkpoint in a background thread (stages/common/handoff.py). The checkpoint's manifest (every
file's size and hash, so its content hash) is known before the first byte reaches the disk: it is
computed from the bytes that will be written. Until the write completes, this process knows the
artifact by that manifest:

- `read_manifest(path)` returns it, so a stage that takes the policy as an input names its content
  hash in its own manifest and cache key exactly as if it had read the file;
- whoever reads the files waits for them first (`wait_until_written`, called by the verified
  readers), so no one reads a half-written checkpoint;
- another process sees nothing until the manifest is on disk (written last, as always): a run
  killed mid-write reruns the stage that produced it.

The registry is process-wide state owned by this module: `register` by the writer before the write
starts, `settled` by the writer when it ends (written or failed); `clear` for tests.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from rlpipe.schemas.manifest import Manifest

_LOCK = threading.Lock()
#: resolved artifact path -> (its manifest, a callable that returns once its files are written)
_PENDING: dict[Path, tuple[Manifest, Callable[[], None]]] = {}


def _key(path: Path | str) -> Path:
    return Path(path).absolute()


def register(path: Path | str, manifest: Manifest, wait: Callable[[], None]) -> None:
    """`path` will hold `manifest`'s artifact once `wait()` returns."""
    with _LOCK:
        _PENDING[_key(path)] = (manifest, wait)


def settled(path: Path | str) -> None:
    """The write of `path` ended (its manifest is on disk, or it failed)."""
    with _LOCK:
        _PENDING.pop(_key(path), None)


def pending_manifest(path: Path | str) -> Manifest | None:
    """The manifest `path` is being written with in this process, if it is."""
    with _LOCK:
        entry = _PENDING.get(_key(path))
    return entry[0] if entry is not None else None


def wait_until_written(path: Path | str) -> None:
    """Return once no write of `path` is pending in this process (at once when none is)."""
    with _LOCK:
        entry = _PENDING.get(_key(path))
    if entry is not None:
        entry[1]()


def clear() -> None:
    with _LOCK:
        _PENDING.clear()
