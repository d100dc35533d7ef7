"""Reading an artifact's manifest: an artifact exists iff `_manifest.json` does (`exists`), and
`read_manifest` returns it once its content hash is that of its own file list. A pruned artifact
is no artifact, but its record still says what it was (`recorded_manifest`, `cached_manifest`).

The bottom of artifact reading: checking the files a manifest lists is `rlpipe.schemas.verify`,
reading a table artifact's rows is `rlpipe.schemas.tables`, both on top of this."""

from __future__ import annotations

from pathlib import Path

from rlpipe.schemas.errors import ArtifactError, ArtifactNotFound, IntegrityError
from rlpipe.schemas.manifest import MANIFEST_NAME, Manifest, content_hash
from rlpipe.schemas.pending import pending_manifest
from rlpipe.schemas.pruning import pruned, pruned_error


def read_manifest(path: Path | str) -> Manifest:
    """The manifest of an artifact; ArtifactNotFound if there is none (missing or incomplete),
    IntegrityError if its content hash is not that of its file list. An artifact this process is
    still writing in the background is known by the manifest it is being written with (pending.py)."""
    path = Path(path)
    mpath = path / MANIFEST_NAME
    if not mpath.is_file():
        decided = pending_manifest(path)
        if decided is not None:
            return decided
        raise not_found_error(path)
    try:
        manifest = Manifest.model_validate_json(mpath.read_bytes())
    except ValueError as e:
        raise ArtifactError(f"{mpath}: not a valid rlpipe manifest: {e}") from None
    check_manifest_hash(manifest, path)
    return manifest


def check_manifest_hash(manifest: Manifest, path: Path | str) -> None:
    """The manifest's content_hash must be the hash of its own file list."""
    if manifest.content_hash != content_hash(manifest.files):
        raise IntegrityError(
            f"{Path(path) / MANIFEST_NAME}: content_hash does not match its file list (the manifest "
            "was edited after it was written); rerun the stage that wrote it (with --force)")


def not_found_error(path: Path) -> ArtifactNotFound:
    """The error for an artifact `path` without a manifest: pruned (`ArtifactPruned`), missing, or
    incomplete."""
    record = pruned(path)
    if record is not None:
        return pruned_error(path, record)
    why = "does not exist" if not path.exists() else "has no _manifest.json (incomplete: its stage did not finish)"
    return ArtifactNotFound(f"artifact {path} {why}")


def exists(path: Path | str) -> bool:
    """Whether `path` is a complete artifact (its manifest is written)."""
    return (Path(path) / MANIFEST_NAME).is_file()


def recorded_manifest(path: Path | str) -> Manifest:
    """The manifest of the artifact at `path`, or, when it was pruned, the manifest it had;
    ArtifactNotFound otherwise. For what is known of an artifact without reading its data: its
    cache key, content hash, config, extra."""
    record = pruned(path)
    return record.manifest if record is not None else read_manifest(path)


def cached_manifest(path: Path | str, key: str) -> Manifest | None:
    """The existing manifest at `path` if it was produced with cache key `key`, else None. An
    artifact pruned after it was produced with that key counts (its recorded manifest): the work
    was done (`rlpipe.schemas.pruning`)."""
    try:
        manifest = recorded_manifest(path)
    except ArtifactError:
        return None
    return manifest if manifest.cache_key == key else None
