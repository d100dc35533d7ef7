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

A process can also be told the manifest another process decided (the resident optimize's policy,
sent over the weight channel or answered to the driver): `register_elsewhere` registers it, and its
readers wait for the manifest to appear on disk.

Process-wide state: the registry is one object per process, `PENDING` (a `PendingWrites`), owned
by this module: the writer calls `register` before the write starts and `settled` when it ends
(written or failed); readers call `pending_manifest` / `wait_until_written`. `PENDING.reset()`
forgets every entry, as a fresh process has none; tests reset it with every other process-wide
object through `rlpipe.stages.common.process_state.reset_process_state()` (this module, the lower
layer, knows nothing of that).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from rlpipe.schemas.errors import MachineError
from rlpipe.schemas.manifest import MANIFEST_NAME, Manifest


class PendingWrites:
    """The artifacts this process is writing whose manifest is already decided."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.entries: dict[Path, tuple[Manifest, Callable[[], None]]] = {}
        """Absolute artifact path -> (its manifest, a callable that returns once its files are
        written). Guarded by the lock: the writer is a background thread."""

    def register(self, path: Path | str, manifest: Manifest, wait: Callable[[], None]) -> None:
        with self._lock:
            self.entries[_key(path)] = (manifest, wait)

    def settled(self, path: Path | str) -> None:
        with self._lock:
            self.entries.pop(_key(path), None)

    def get(self, path: Path | str) -> tuple[Manifest, Callable[[], None]] | None:
        with self._lock:
            return self.entries.get(_key(path))

    def reset(self) -> None:
        """Forget every pending write (a fresh process has none)."""
        with self._lock:
            self.entries.clear()


#: This process's pending writes (see the module doc).
PENDING = PendingWrites()


def _key(path: Path | str) -> Path:
    return Path(path).absolute()


def register(path: Path | str, manifest: Manifest, wait: Callable[[], None]) -> None:
    """`path` will hold `manifest`'s artifact once `wait()` returns."""
    PENDING.register(path, manifest, wait)


def settled(path: Path | str) -> None:
    """The write of `path` ended (its manifest is on disk, or it failed)."""
    PENDING.settled(path)


def pending_manifest(path: Path | str) -> Manifest | None:
    """The manifest `path` is being written with in this process, if it is."""
    entry = PENDING.get(path)
    return entry[0] if entry is not None else None


def wait_for_manifest(path: Path | str, *, alive: Callable[[], bool] | None = None,
                      failed: Callable[[], Exception | None] | None = None, poll_s: float = 0.01) -> None:
    """Return once artifact `path`'s manifest is on disk (written last by its writer, in another
    process); `alive()`, when given, is asked at each look and False ends the wait with a
    MachineError (the writer's process lost before the artifact was complete: a rerun makes it
    again, the same bytes); `failed()`, when given, is the error the writer reported for one of
    its background writes (a full disk), raised as it is."""
    manifest = Path(path) / MANIFEST_NAME
    while not manifest.is_file():
        if failed is not None and (error := failed()) is not None and not manifest.is_file():
            raise error
        if alive is not None and not alive() and not manifest.is_file():
            raise MachineError(f"{path}: the process writing it in the background was lost before it was "
                               "complete; rerun the same command to resume (its stage makes it again, the "
                               "same bytes)")
        time.sleep(poll_s)


def register_elsewhere(path: Path | str, manifest: Manifest, *, alive: Callable[[], bool] | None = None,
                       failed: Callable[[], Exception | None] | None = None) -> None:
    """`path` will hold `manifest`'s artifact, decided and written by another process: known by it
    here until then, its readers waiting for its manifest on disk (`wait_for_manifest`)."""

    def wait() -> None:
        wait_for_manifest(path, alive=alive, failed=failed)
        settled(path)

    register(path, manifest, wait)


def wait_until_written(path: Path | str) -> None:
    """Return once no write of `path` is pending in this process (at once when none is)."""
    entry = PENDING.get(path)
    if entry is not None:
        entry[1]()
