"""The weight channel's same-host path: a checkpoint's bytes through one file in shared memory.

Over gloo a hand-off between two processes of one machine still crosses the loopback's TCP stack
(measured here: 0.24 s for an 80M-parameter fp32 policy, 331 MB, on two cores). When every member
of a generation sees the sender's shared memory (the same /dev/shm: tried at the join with a probe
file whose random content only a process of this machine can read back), the sender writes the
checkpoint's files once into a file there (one copy, from the pieces as they lie), the members map
it (no copy: the delivery's tensors are views of the mapping, which stays valid after the file is
unlinked), and one all-reduce over the channel's group says every member has it; then the file
goes. The manifest check (size and hash of every file) is the same as for broadcast bytes.

A member that dies before the all-reduce breaks it at once (gloo sees the socket close), as a
broadcast would; a sender killed with the file still there leaves it behind under its host name and
pid, and the next sender on this machine removes every such file whose process is gone (`sweep`).

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


def write(tag: str, pieces: Mapping[str, Sequence[memoryview | bytes | bytearray]]) -> Path | None:
    """Every file's pieces, back to back in file order, into one new shared-memory file; None
    (and nothing left) when it cannot be written (a full tmpfs): the bytes go by broadcast."""
    path = _name(tag)
    try:
        with open(path, "wb") as f:
            for parts in pieces.values():
                for part in parts:
                    f.write(part)
    except OSError:
        remove(path)
        return None
    return path


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
