"""One writer per run directory: `runs/<run>/.lock`, held by the process running the pipeline.

The lock is an `flock` on that file, so the kernel releases it when its owner dies however it
dies (SIGKILL included): a lock file left behind by a dead process is stale by construction and
is taken over, with a line naming the old owner. The file holds the owner's pid, host and start
time, so a second writer is refused with a message naming them.

A run directory this process cannot write (a read-only mount) takes no lock: nothing can write
there, and a complete run still reruns (every stage a cache hit).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from rlpipe.cluster.workorders import this_process
from rlpipe.schemas.errors import UserError

_log = logging.getLogger(__name__)

LOCK_NAME = ".lock"


class RunLocked(UserError):
    """Another live process holds the run directory's lock."""


def _owner(text: str) -> str:
    try:
        info = json.loads(text)
        return f"pid {info['pid']} on host {info['host']} (since {info['started']})"
    except (ValueError, KeyError, TypeError):
        return "an unknown process (unreadable lock file)"


def _open(path: Path) -> int | None:
    """The lock file, opened (created) for writing; None on a read-only run directory."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return None
        raise


@contextlib.contextmanager
def run_lock(run_dir: Path | str, log: Callable[[str], None] | None = None) -> Iterator[bool]:
    """Hold the lock of `run_dir` for the block, which gets True; RunLocked if another live process
    holds it. On a read-only run directory no lock is taken and the block gets False."""
    run_dir, log = Path(run_dir), log or _log.info
    path = run_dir / LOCK_NAME
    while True:
        fd = _open(path)
        if fd is None:
            log(f"{run_dir} is not writable: no run lock taken (only cached stages can run)")
            yield False
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 4096, 0).decode(errors="replace")
            os.close(fd)
            raise RunLocked(
                f"{run_dir} is in use by {_owner(text)} (lock file {path}); wait for it to finish, "
                f"stop it, or pass another run directory (--run-dir DIR)") from None
        # The previous owner may have removed the file between our open and our flock: then we
        # hold a lock on an unlinked inode; start over on the file now at `path`.
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        previous = os.pread(fd, 4096, 0).decode(errors="replace")
        if previous.strip():
            log(f"taking over the stale lock of {_owner(previous)}: that process is gone")
        # who holds it (`this_process`, the identity resident groups record) and since when, for the message
        holder = json.dumps({**this_process(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        yield True
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)  # releases the flock
