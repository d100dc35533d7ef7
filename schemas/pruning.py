"""Pruned artifacts: what a run's `keep` rule (`rlpipe.pipelines.keep`) deleted, remembered in place.

Pruning an artifact deletes its files but leaves its directory holding one file, `_pruned.json`:
the manifest the artifact had (content hash, cache key, stage, config, inputs), why it went (the
`keep` setting) and the bytes freed. An artifact exists if and only if its manifest does, so a
pruned one is no artifact any more: reading it fails with `ArtifactPruned`, which names it and
the keep setting. What it was is still known (`rlpipe.schemas.reading.recorded_manifest`), and
that is all a rerun needs of it:

- the stage that wrote it finds its work done: a cache hit on the recorded cache key;
- a stage that read it still gets its content hash for its own cache key.

So resuming or extending a pruned run skips everything finished without reading a deleted byte;
only a stage that must recompute from a pruned input fails, naming that input.

This module is the record and reading it; the deletion itself (and the order of its steps, so a
crash leaves a complete artifact or a pruned one) is `rlpipe.pipelines.keep.prune_artifact`.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

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


def pruned_error(path: Path | str, record: Pruned, *, role: str = "") -> ArtifactPruned:
    """`ArtifactPruned` for reading `path` (as the input `role`), naming the keep setting."""
    what = f"{role}: " if role else ""
    return ArtifactPruned(
        f"{what}{path} was pruned ({record.pruned_at}, {record.reason}); its data are gone, only its record "
        f"remains. Keep more (the preset's `keep:` section) and recompute it, or rerun from an artifact that "
        "is still there")
