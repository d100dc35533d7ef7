"""Verified reads: every file an artifact lists is checked against the sha256 its manifest holds
before it is used, so a shard or checkpoint changed after its manifest stops the reader with the
file named, instead of being trained on.

The cheap path (measured by benchmarks/bench_verify.py):
- a shard is read into memory once, hashed there and decoded from that buffer (one read of the
  disk, not two);
- a file already verified by this process is not hashed again while its stat (device, inode,
  size, mtime, ctime) is unchanged. Any write changes ctime, which no user can set back; an entry
  is trusted only once its ctime is older than the check by more than the timestamp granularity
  (git's "racily clean" rule), so a change within the same clock tick is still caught.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from rlpipe.schemas.errors import ArtifactError, IntegrityError
from rlpipe.schemas.manifest import MANIFEST_NAME, FileInfo, Manifest, content_hash

# Coarse file timestamps: ext4/xfs tick at most every 10 ms, NFS and some FUSE file systems at 1 s.
_RACY_NS = 1_000_000_000

# (st_dev, st_ino) -> (size, mtime_ns, ctime_ns, sha256) of files this process verified.
_VERIFIED: dict[tuple[int, int], tuple[int, int, int, str]] = {}
_MAX_ENTRIES = 100_000


def _stat_key(st: os.stat_result) -> tuple[tuple[int, int], tuple[int, int, int]]:
    return (st.st_dev, st.st_ino), (st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def known_hash(path: Path | str) -> str | None:
    """The sha256 this process verified for `path`, if the file is provably unchanged since."""
    try:
        ident, stamp = _stat_key(os.stat(path))
    except OSError:
        return None
    entry = _VERIFIED.get(ident)
    return entry[3] if entry is not None and entry[:3] == stamp else None


def remember_hash(path: Path | str, sha256: str, st: os.stat_result | None = None) -> None:
    """Record that `path` (as stat `st`, taken before it was read) hashes to `sha256`; only when
    its last change is older than the racy window, so a same-tick change is never hidden."""
    st = st if st is not None else os.stat(path)
    if time.time_ns() - st.st_ctime_ns <= _RACY_NS:
        return
    if len(_VERIFIED) >= _MAX_ENTRIES:
        _VERIFIED.clear()
    ident, stamp = _stat_key(st)
    _VERIFIED[ident] = (*stamp, sha256)


def _mismatch(path: Path, info: FileInfo, actual: str, size: int) -> IntegrityError:
    what = (f"{size} bytes, the manifest says {info.bytes}" if size != info.bytes
            else f"sha256 {actual[:16]}..., the manifest says {info.sha256[:16]}...")
    return IntegrityError(
        f"{path}: content differs from {path.parent / MANIFEST_NAME} ({what}): the file was changed "
        "after its artifact was written; rerun the stage that wrote it (with --force) or restore it")


def verify_file(path: Path | str, info: FileInfo) -> None:
    """Check one listed file against its manifest entry (hash memoised as described above)."""
    path = Path(path)
    if known_hash(path) == info.sha256:
        return
    try:
        st = path.stat()
    except FileNotFoundError:
        raise IntegrityError(f"{path}: listed in {path.parent / MANIFEST_NAME} but missing") from None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    actual = h.hexdigest()
    if actual != info.sha256 or st.st_size != info.bytes:
        raise _mismatch(path, info, actual, st.st_size)
    remember_hash(path, actual, st)


def read_verified(path: Path | str, info: FileInfo) -> bytes:
    """The bytes of a listed file, read once and checked against its manifest entry."""
    path = Path(path)
    try:
        st = path.stat()
        data = path.read_bytes()
    except FileNotFoundError:
        raise IntegrityError(f"{path}: listed in {path.parent / MANIFEST_NAME} but missing") from None
    actual = hashlib.sha256(data).hexdigest()
    if actual != info.sha256 or len(data) != info.bytes:
        raise _mismatch(path, info, actual, len(data))
    remember_hash(path, actual, st)
    return data


def check_manifest_hash(manifest: Manifest, path: Path | str) -> None:
    """The manifest's content_hash must be the hash of its own file list."""
    if manifest.content_hash != content_hash(manifest.files):
        raise IntegrityError(
            f"{Path(path) / MANIFEST_NAME}: content_hash does not match its file list (the manifest "
            "was edited after it was written); rerun the stage that wrote it (with --force)")


def listed_entry(path: Path | str) -> FileInfo | None:
    """The manifest entry of a shard `path` from its directory's manifest; None when the directory
    has no manifest (a stage's own staging directory, or a loose file). A complete artifact that
    does not list the file is an IntegrityError."""
    from rlpipe.schemas.reading import read_manifest

    path = Path(path)
    if not (path.parent / MANIFEST_NAME).is_file():
        return None
    manifest = read_manifest(path.parent)
    for info in manifest.files:
        if info.name == path.name:
            return info
    raise IntegrityError(f"{path}: not listed in {path.parent / MANIFEST_NAME} (added after the "
                         "artifact was written); remove it or rerun the stage that wrote the artifact")


def verify_checkpoint(path: Path | str) -> Manifest | None:
    """Check a checkpoint directory against its manifest before it is loaded: every listed file
    present with its sha256, no other (non-hidden) file beside them. Returns the manifest, or None
    for a directory without one (a Hugging Face directory made outside rlpipe: nothing promised).
    """
    from rlpipe.schemas.reading import read_manifest

    path = Path(path)
    if not (path / MANIFEST_NAME).is_file():
        return None
    manifest = read_manifest(path)
    if manifest.kind != "checkpoint":
        raise ArtifactError(f"{path} is a {manifest.kind} artifact, not a checkpoint")
    listed = {f.name for f in manifest.files}
    for info in manifest.files:
        verify_file(path / info.name, info)
    stray = sorted(str(p.relative_to(path)) for p in path.rglob("*")
                   if p.is_file() and p.name != MANIFEST_NAME and not p.name.startswith(".")
                   and str(p.relative_to(path)) not in listed)
    if stray:
        raise IntegrityError(f"{path}: files not listed in its {MANIFEST_NAME}: {stray} (added after the "
                             "checkpoint was written); remove them or rerun the stage that wrote it")
    return manifest
