"""Verified reads: every file an artifact lists is checked against the hash its manifest holds
(xxh3-128, or sha256 in manifests written before: schemas/hashing.py) before it is used, so a
shard or checkpoint changed after its manifest stops the reader with the file named, instead of
being trained on. (The manifest itself is read, and its content hash checked, by
rlpipe.schemas.reading.)

A file is opened once, and what is checked is that open file, never its path again: another
process may swap a new version of the artifact in at any moment (a `--force` rerun exchanges the
whole directory, rlpipe.schemas.staging), and a name looked up twice can name two files. Each file
is checked against the entry of the one manifest the reader read first, so a file of another
version fails as IntegrityError instead of mixing in.

The cheap path (measured by benchmarks/bench_verify.py):
- a shard is read into memory once from its open file, hashed there and decoded from that buffer
  (one read of the disk, not two; the bytes decoded are the bytes hashed);
- a file already verified on this machine is not hashed again while the stat of the open file
  (device, inode, size, mtime, ctime) is unchanged: it is decoded from that open file. Any write
  changes ctime, which no user can set back; an entry is trusted only once its ctime is older than
  the check by more than the timestamp granularity (git's "racily clean" rule), so a change within
  the same clock tick is still caught, as is a new file given a recycled inode number.
- "on this machine": a verification is remembered in this process and in a folder of the machine
  the user alone can write (`verified_dir()`: /dev/shm/rlpipe-verified-<uid>, or
  $RLPIPE_VERIFIED_DIR), one tiny file per (device, inode), so the rollout workers, ranks and
  stage processes of one node hash a file once between them, not once each.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from rlpipe.schemas.errors import ArtifactError, IntegrityError
from rlpipe.schemas.hashing import CHUNK, digest_bytes, new_hasher
from rlpipe.schemas.manifest import MANIFEST_NAME, FileInfo, Manifest
from rlpipe.schemas.pending import wait_until_written
from rlpipe.schemas.reading import read_manifest

# Coarse file timestamps: ext4/xfs tick at most every 10 ms, NFS and some FUSE file systems at 1 s.
_RACY_NS = 1_000_000_000

# (st_dev, st_ino) -> (size, mtime_ns, ctime_ns, tagged digest) of files verified on this machine
# (this process's memo of the machine's, see the module doc; `forget_verified` clears both).
_VERIFIED: dict[tuple[int, int], tuple[int, int, int, str]] = {}
_MAX_ENTRIES = 100_000


def verified_dir() -> Path:
    """The machine's memo of verified files (see the module doc)."""
    configured = os.environ.get("RLPIPE_VERIFIED_DIR")
    if configured:
        return Path(configured)
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else Path(
        os.environ.get("TMPDIR", "/tmp"))
    return base / f"rlpipe-verified-{os.getuid()}"


def _stat_key(st: os.stat_result) -> tuple[tuple[int, int], tuple[int, int, int]]:
    return (st.st_dev, st.st_ino), (st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _remembered(st: os.stat_result) -> str | None:
    """The tagged digest verified on this machine for the file of stat `st`, if provably
    unchanged since (this process's memo first, then the machine's)."""
    ident, stamp = _stat_key(st)
    entry = _VERIFIED.get(ident)
    if entry is None:
        entry = _machine_entry(ident)
        if entry is not None:
            _VERIFIED[ident] = entry
    return entry[3] if entry is not None and entry[:3] == stamp else None


def _machine_entry(ident: tuple[int, int]) -> tuple[int, int, int, str] | None:
    folder = verified_dir()
    try:
        st = os.stat(folder)
        if st.st_uid != os.getuid() or st.st_mode & 0o022:  # only a folder no one else can write
            return None
        size, mtime, ctime, digest = (folder / f"{ident[0]}-{ident[1]}").read_text().split()
        return int(size), int(mtime), int(ctime), digest
    except (OSError, ValueError):
        return None


def known_hash(path: Path | str) -> str | None:
    """The tagged digest verified on this machine for `path`, if provably unchanged since."""
    try:
        return _remembered(os.stat(path))
    except OSError:
        return None


def remember_hash(path: Path | str, digest: str, st: os.stat_result | None = None) -> None:
    """Record that `path` (as stat `st`, taken before it was read) has the tagged `digest`
    (`FileInfo.tagged_digest`), in this process and for the machine; only when its last change is
    older than the racy window, so a same-tick change is never hidden."""
    st = st if st is not None else os.stat(path)
    if time.time_ns() - st.st_ctime_ns <= _RACY_NS:
        return
    if len(_VERIFIED) >= _MAX_ENTRIES:
        _VERIFIED.clear()
    ident, stamp = _stat_key(st)
    _VERIFIED[ident] = (*stamp, digest)
    folder = verified_dir()
    entry = folder / f"{ident[0]}-{ident[1]}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        tmp = entry.with_name(f".{entry.name}.{os.getpid()}")
        tmp.write_text(f"{stamp[0]} {stamp[1]} {stamp[2]} {digest}\n")
        os.replace(tmp, entry)  # (whole, for any reader)
    except OSError:  # a read-only or full /dev/shm: this process's memo still holds it
        pass


def forget_verified() -> None:
    """Forget every verification, this process's and the machine's (benchmarks of a cold read,
    tests)."""
    import shutil

    _VERIFIED.clear()
    shutil.rmtree(verified_dir(), ignore_errors=True)


def _mismatch(path: Path, info: FileInfo, actual: str, size: int) -> IntegrityError:
    what = (f"{size} bytes, the manifest says {info.bytes}" if size != info.bytes
            else f"{info.algorithm} {actual[:16]}..., the manifest says {info.digest[:16]}...")
    return IntegrityError(
        f"{path}: content differs from {path.parent / MANIFEST_NAME} ({what}): the file was changed "
        "after its artifact was written (or the artifact was rewritten while it was read: read it again); "
        "rerun the stage that wrote it (with --force) or restore it")


@contextlib.contextmanager
def _open_listed(path: Path, info: FileInfo | None) -> Iterator[tuple[pa.OSFile, os.stat_result]]:
    """`path` opened once for reading, with the stat of the open file (not of the name, which
    may name another file by now); a listed file that is missing is an IntegrityError."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        if info is None:
            raise
        raise IntegrityError(f"{path}: listed in {path.parent / MANIFEST_NAME} but missing") from None
    with pa.OSFile(fd, mode="r") as f:  # (owns fd: closed on exit)
        yield f, os.fstat(fd)


def _check(path: Path, info: FileInfo, actual: str, size: int, st: os.stat_result) -> None:
    """The hex digest (of `info.algorithm`) of the open file `st` against its manifest entry;
    remembered when they agree."""
    if actual != info.digest or size != info.bytes:
        raise _mismatch(path, info, actual, size)
    remember_hash(path, info.tagged_digest, st)


def verify_file(path: Path | str, info: FileInfo) -> None:
    """Check one listed file against its manifest entry (hash memoised as described above),
    streamed: a checkpoint's weights are never held in memory for it."""
    path = Path(path)
    with _open_listed(path, info) as (f, st):
        if _remembered(st) == info.tagged_digest:
            return
        h, size = new_hasher(info.algorithm), 0
        while (chunk := f.read_buffer(CHUNK)).size:
            h.update(chunk)
            size += chunk.size
        _check(path, info, h.hexdigest(), size, st)


@contextlib.contextmanager
def open_verified(path: Path | str, info: FileInfo | None) -> Iterator[pa.NativeFile]:
    """A listed file opened once, as bytes to decode that are the bytes its manifest entry
    `info` promises: the open file itself when this process verified it before (same inode,
    size, mtime and ctime), else its content read from that open file into memory and hashed
    there. IntegrityError, naming the file, otherwise. `info` None (a staging directory, which
    has no manifest yet): the open file, unchecked."""
    path = Path(path)
    with _open_listed(path, info) as (f, st):
        if info is None or _remembered(st) == info.tagged_digest:
            yield f
            return
        data = f.read_buffer()
        _check(path, info, digest_bytes(data, info.algorithm), data.size, st)
        yield pa.BufferReader(data)


def listed_entry(path: Path | str) -> FileInfo | None:
    """The manifest entry of a shard `path` from its directory's manifest; None when the directory
    has no manifest (a stage's own staging directory, or a loose file). A complete artifact that
    does not list the file is an IntegrityError."""
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
    present with its hash (but those it says were never written), no other (non-hidden) file
    beside them. Returns the manifest, or None
    for a directory without one (a Hugging Face directory made outside rlpipe: nothing promised).
    """
    path = Path(path)
    wait_until_written(path)  # (a checkpoint this process is writing in the background)
    if not (path / MANIFEST_NAME).is_file():
        return None
    manifest = read_manifest(path)
    if manifest.kind != "checkpoint":
        raise ArtifactError(f"{path} is a {manifest.kind} artifact, not a checkpoint")
    listed = {f.name for f in manifest.files}
    for info in manifest.files:
        if info.name not in manifest.not_written:  # (weights only memory held: `Manifest.not_written`)
            verify_file(path / info.name, info)
    stray = sorted(str(p.relative_to(path)) for p in path.rglob("*")
                   if p.is_file() and p.name != MANIFEST_NAME and not p.name.startswith(".")
                   and str(p.relative_to(path)) not in listed)
    if stray:
        raise IntegrityError(f"{path}: files not listed in its {MANIFEST_NAME}: {stray} (added after the "
                             "checkpoint was written); remove them or rerun the stage that wrote it")
    return manifest
