"""The weight channel's same-host path: a checkpoint's bytes through one file in shared memory.

Over gloo a hand-off between two processes of one machine still crosses the loopback's TCP stack
(measured here: 0.24 s for an 80M-parameter fp32 policy, 331 MB, on two cores). When every member
of a generation sees the sender's shared memory (the same /dev/shm: tried at the join with a probe
file whose random content only a process of this machine can read back), the sender writes the
checkpoint's files once into a file there (one copy, from the pieces as they lie; into a file
allocated beforehand, while optimize trained: `Spare`), the members map it (no copy: the
delivery's tensors are views of the mapping, which stays valid after the file is unlinked), and
the last member to map it removes it (a counter in the channel's store). The manifest check (size
and hash of every file) is the same as for broadcast bytes.

The sender does not wait for the members: one that dies before it maps the file leaves it, which
the sender removes at its next send. A sender killed with its files still there leaves them
behind under its host name and pid, and the next sender on this machine removes every such file
whose process is gone (`sweep`).

A vLLM member, whose engine's workers load a checkpoint by path, writes a delivery it received as
a checkpoint folder here (`as_folder`): its weights come from memory, not from the disk optimize is
still writing them to.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import shutil
import socket
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from rlpipe.schemas.staging import pid_alive

#: Where the files go: a tmpfs on Linux (memory, not disk).
SHM = Path("/dev/shm")
PREFIX = "rlpipe-weights"


def _name(tag: str) -> Path:
    return SHM / f"{PREFIX}-{socket.gethostname()}-{os.getpid()}-{tag}"


def probe(tag: str) -> tuple[str, str] | None:
    """A probe file (path, its random content) for the members to read back, or None where this
    machine has no shared-memory folder to write."""
    nonce = secrets.token_hex(16)
    path = _name(f"{tag}-probe")
    try:
        path.write_text(nonce)
    except OSError:
        return None
    return str(path), nonce


def sees(path: str | None, nonce: str | None) -> bool:
    """Whether this process reads the sender's probe (it shares the sender's memory)."""
    if not path or not nonce:
        return False
    try:
        return Path(path).read_text() == nonce
    except OSError:
        return False


def write(tag: str, pieces: Mapping[str, Sequence[memoryview | bytes | bytearray]],
          spare: Path | None = None) -> Path | None:
    """Every file's pieces, back to back in file order, into one shared-memory file (`spare`, a
    file of exactly their size allocated beforehand, where given: `Spare`); None (and nothing
    left) when it cannot be written (a full tmpfs): the bytes go by broadcast."""
    path = _name(tag)
    try:
        if spare is not None:
            os.replace(spare, path)
        with open(path, "r+b" if spare is not None else "wb") as f:
            for parts in pieces.values():
                for part in parts:
                    f.write(part)
    except OSError:
        remove(path)
        return None
    return path


class Spare:
    """A shared-memory file allocated ahead of the next hand-off, off its critical path.

    Written into a new tmpfs file, a checkpoint's bytes wait for the kernel to find and zero each
    page as it is written: 0.20 s for the 80M policy (331 MB) here, against 0.09 s into pages
    allocated beforehand (`posix_fallocate`: 0.13 s, on a thread while optimize trains). The
    sender prepares a spare of the size it just sent (a policy's files keep their size from one
    iteration to the next) and its next `write` takes it. The cost: between hand-offs /dev/shm holds
    the policy's size once more than before (the members' mappings of the last one, and the
    spare), where it held it twice only during a send. A spare that cannot be allocated (a full
    tmpfs) is no spare: the next write goes as before."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._ready: tuple[Path, int] | None = None
        self._made = 0

    def prepare(self, size: int) -> None:
        """Allocate a spare of `size` bytes on a thread of its own (the previous one goes)."""
        self.discard()
        self._made += 1
        path = _name(f"spare-{self._made}")

        def allocate() -> None:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.posix_fallocate(fd, 0, size)
                finally:
                    os.close(fd)
            except OSError:
                remove(path)
                return
            self._ready = (path, size)

        self._thread = threading.Thread(target=allocate, name="rlpipe-shm-spare", daemon=True)
        self._thread.start()

    def take(self, size: int) -> Path | None:
        """The spare, once allocated, when it has `size` bytes; else None (and it goes)."""
        self._join()
        if self._ready is not None and self._ready[1] == size:
            path, self._ready = self._ready[0], None
            return path
        self.discard()
        return None

    def discard(self) -> None:
        self._join()
        ready, self._ready = self._ready, None
        remove(ready and ready[0])

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def read(path: str, files: Sequence[tuple[str, Sequence[int]]]) -> dict[str, torch.Tensor]:
    """The files a header lists ([name, piece sizes] in order) as uint8 views of `path` mapped
    copy-on-write (writable views, nothing copied until written; the mapping outlives the file)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        total = sum(sum(pieces) for _, pieces in files)
        if size != total:
            raise ValueError(f"{path} holds {size} bytes, not the {total} its header lists")
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else bytearray()
    data = torch.frombuffer(mapped, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    out, offset = {}, 0
    for name, pieces in files:
        out[name] = data[offset:offset + sum(pieces)]
        offset += sum(pieces)
    return out


def as_folder(files: Mapping[str, torch.Tensor], tag: str) -> Path:
    """Files held in memory (name -> uint8 bytes) written as a folder in shared memory, for a
    reader that takes a checkpoint by path (vLLM's workers); `remove` it when read."""
    folder = _name(tag)
    remove(folder)
    folder.mkdir()
    try:
        for name, data in files.items():
            with open(folder / name, "wb") as f:
                f.write(memoryview(data.cpu().numpy()))  # (a weight file handed over on the GPU: its bytes come down)
    except BaseException:
        remove(folder)
        raise
    return folder


def remove(path: Path | str | None) -> None:
    """Remove a file or folder this module wrote (nothing when it is gone already)."""
    if path is None:
        return
    if Path(path).is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def sweep() -> None:
    """Remove the files a sender of this machine left when it was killed (its pid is gone)."""
    host = socket.gethostname()
    for path in SHM.glob(f"{PREFIX}-{host}-*"):
        pid = path.name[len(f"{PREFIX}-{host}-"):].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            remove(path)
