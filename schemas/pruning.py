"""Pruned artifacts: what a run's `keep` rule (`rlpipe.pipelines.keep`) deleted, remembered in place.

Pruning an artifact deletes its files but leaves its directory holding one file, `_pruned.json`:
the manifest the artifact had (content hash, cache key, stage, config, inputs), why it went (the
`keep` setting) and the bytes freed. An artifact exists if and only if its manifest does, so a
pruned one is no artifact any more: reading it fails with `ArtifactPruned`, which names it and
the keep setting. What it was is still known, and that is all a rerun needs of it:

- the stage that wrote it finds its work done: a cache hit on the recorded cache key;
- a stage that read it still gets its content hash for its own cache key.

So resuming or extending a pruned run skips everything finished without reading a deleted byte;
only a stage that must recompute from a pruned input fails, naming that input.

Order of deletion, so that a crash anywhere leaves a complete artifact or a pruned one, never
something that looks like either but is not: the tombstone is written (atomically) into the
directory, then the manifest is removed, then the other files.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from rlpipe.schemas.atomic import atomic_write_bytes
from rlpipe.schemas.errors import ArtifactNotFound, UserError
from rlpipe.schemas.manifest import MANIFEST_NAME, Manifest

PRUNED_NAME = "_pruned.json"


class ArtifactPruned(ArtifactNotFound, UserError):
    """The artifact was deleted by the run's `keep` rule (its record says what it was)."""


class Pruned(BaseModel):
    """The record a pruned artifact leaves behind."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    manifest: Manifest
    """The manifest the artifact had."""
    reason: str
    """Why it went: the keep setting (e.g. 'keep.train_states=2: only the last 2 are kept')."""
    bytes: int
    """Bytes its files took."""
    pruned_at: str


def pruned(path: Path | str) -> Pruned | None:
    """The record of a pruned artifact at `path`, or None (not pruned: complete, missing, partial)."""
    record = Path(path) / PRUNED_NAME
    if (Path(path) / MANIFEST_NAME).is_file() or not record.is_file():
        return None
    return Pruned.model_validate_json(record.read_bytes())


def recorded_manifest(path: Path | str) -> Manifest:
    """The manifest of the artifact at `path`, or, when it was pruned, the manifest it had;
    ArtifactNotFound otherwise. For what is known of an artifact without reading its data: its
    cache key, content hash, config, extra."""
    from rlpipe.schemas.reading import read_manifest

    record = pruned(path)
    return record.manifest if record is not None else read_manifest(path)


def pruned_error(path: Path | str, record: Pruned, *, role: str = "") -> ArtifactPruned:
    """`ArtifactPruned` for reading `path` (as the input `role`), naming the keep setting."""
    what = f"{role}: " if role else ""
    return ArtifactPruned(
        f"{what}{path} was pruned ({record.pruned_at}, {record.reason}); its data are gone, only its record "
        f"remains. Keep more (the preset's `keep:` section) and recompute it, or rerun from an artifact that "
        "is still there")


def artifact_bytes(path: Path | str) -> int:
    """Bytes of every file under `path`."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def prune_artifact(path: Path | str, reason: str) -> int:
    """Delete the artifact at `path`, leaving its record (see the module doc); returns the bytes
    freed. The artifact must be complete."""
    from rlpipe.schemas.reading import read_manifest

    path = Path(path)
    manifest = read_manifest(path)
    size = artifact_bytes(path)
    record = Pruned(manifest=manifest, reason=reason, bytes=size,
                    pruned_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    atomic_write_bytes(path / PRUNED_NAME, record.model_dump_json(indent=1).encode(), fsync=True)
    (path / MANIFEST_NAME).unlink()  # from here on it is pruned, not an artifact
    remove_pruned_files(path)
    return size


def remove_pruned_files(path: Path) -> None:
    """Remove everything but the record under a pruned artifact (what a crash left is removed
    by the next prune)."""
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            if Path(root) != path or name != PRUNED_NAME:
                os.unlink(os.path.join(root, name))
        for name in dirs:
            os.rmdir(os.path.join(root, name))
