"""Staged rewrites: an artifact is written into a hidden staging directory beside its final path
and swapped into place only when complete, so the previous artifact stays whole until the new one
is, and a failed (or killed) `--force` rerun destroys nothing.

    runs/x/iter_0000/.scores.staging-<host>-<pid>/    one process writing `scores`
    runs/x/iter_0000/.scores.staging/                 N worker processes sharing `scores`
    runs/x/iter_0000/scores/                          the artifact (swapped in, complete)

The swap is one `renameat2(RENAME_EXCHANGE)` when the final directory exists (atomic: a reader
sees the old artifact or the new one, never neither), a plain rename when it does not. A process
killed between the exchange and removing the old copy leaves it under the hidden staging name,
which the next writer removes. Staging directories of dead processes on this host are removed
when a writer opens; another process's (or another host's) are never touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

from rlpipe.schemas.errors import ArtifactError

STAGING = ".staging"

# Private staging directories this process opened and has not swapped in yet.
_OPEN: set[Path] = set()


def _host() -> str:
    return socket.gethostname().replace("-", "_")


def staging_path(path: Path | str, *, shared: bool = False) -> Path:
    """Where the artifact `path` is written before its swap: `.<name>.staging-<host>-<pid>` for
    one process, `.<name>.staging` for the workers that share it (or ranks that save together)."""
    path = Path(path)
    tail = "" if shared else f"-{_host()}-{os.getpid()}"
    return path.with_name(f".{path.name}{STAGING}{tail}")


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_staging(path: Path | str) -> None:
    """Remove the private staging directories of `path` left by dead processes of this host."""
    path = Path(path)
    if not path.parent.is_dir():
        return
    prefix = f".{path.name}{STAGING}-{_host()}-"
    for d in path.parent.iterdir():
        if d.name.startswith(prefix) and d.name[len(prefix):].isdigit():
            pid = int(d.name[len(prefix):])
            if pid != os.getpid() and not pid_alive(pid):
                shutil.rmtree(d, ignore_errors=True)


def open_staging(path: Path | str, *, shared: bool = False, fresh: bool = True) -> Path:
    """Create (a `fresh`, empty one) and return the staging directory of `path`."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a directory; remove it or choose another output")
    remove_stale_staging(path)
    staging = staging_path(path, shared=shared)
    try:
        if fresh and staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ArtifactError(f"{path}: cannot create its staging directory {staging.name} beside it "
                            f"({e.strerror}); choose a writable output") from None
    if not shared:
        _OPEN.add(staging)
    return staging


def discard_open_staging() -> None:
    """Remove every private staging directory this process has open (a stage failed or was
    interrupted: nothing partial is left behind). Shared ones belong to the worker group."""
    while _OPEN:
        shutil.rmtree(_OPEN.pop(), ignore_errors=True)


#: Free bytes below which a failed write is put down to a full disk.
NEARLY_FULL = 1 << 20


def no_space_left(folder: Path) -> bool:
    """Whether the filesystem holding `folder` (or its nearest existing parent) is full."""
    folder = Path(folder)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free < NEARLY_FULL
    except OSError:
        return False


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two directories (Linux renameat2); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, f"cannot swap {a} into {b}: {os.strerror(err)}")


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def swap_into_place(staging: Path | str, path: Path | str, *, keep_subdirs: bool = False) -> None:
    """Make the complete staging directory the artifact at `path`; the old one (if any) is removed.

    Args:
        keep_subdirs: carry the sub-directories of the old `path` over (a table artifact's own
            content is files; a stage may have written nested artifacts inside its output first,
            as evaluate does with eval/rollouts and eval/scores).
    """
    staging, path = Path(staging), Path(path)
    _OPEN.discard(staging)
    if keep_subdirs and path.is_dir():
        for d in path.iterdir():
            if d.is_dir() and not d.name.startswith(".") and not (staging / d.name).exists():
                os.rename(d, staging / d.name)
    if path.exists() and _exchange(staging, path):
        shutil.rmtree(staging)  # now the old artifact
    else:
        if path.exists():  # no exchange on this file system: move the old one aside first
            old = path.with_name(f".{path.name}.old-{_host()}-{os.getpid()}")
            os.rename(path, old)
            os.rename(staging, path)
            shutil.rmtree(old)
        else:
            os.rename(staging, path)
    _fsync_dir(path.parent)


@contextlib.contextmanager
def staged_directory(path: Path | str, *, write: bool = True, shared: bool = False) -> Iterator[Path]:
    """Write a directory artifact (a checkpoint) in staging; swap it in when the block succeeds.

        with staged_directory(config.output, write=rank == 0) as tmp:
            save_module(engine, tokenizer, tmp, rank)      # collective: every rank enters
            if rank == 0:
                commit_directory(tmp, stage=..., ...)      # the manifest, last
        # here config.output is the new checkpoint; on an exception the old one is untouched

    Args:
        write: False on processes that take part in the save but do not own it (ranks other than
            0): they get the path without creating, swapping or removing anything.
        shared: every rank writes files into the staging directory (a DeepSpeed checkpoint's
            per-rank shards), so its name is the same in every process (`.<name>.staging`).
    """
    path = Path(path)
    staging = open_staging(path, shared=shared) if write else staging_path(path, shared=shared)
    try:
        yield staging
    except BaseException as e:
        raise_staging_failure(e, staging, path, write=write)
    if write:
        swap_into_place(staging, path)


def raise_staging_failure(e: BaseException, staging: Path, path: Path, *, write: bool = True) -> None:
    """Writing the checkpoint `path` in `staging` failed with `e`: remove the staging directory
    (when this process owns it) and raise, a full disk or an OS error as an ArtifactError that says
    the previous checkpoint is untouched."""
    # Libraries word a full disk their own way (torch.save: "[enforce fail at
    # inline_container.cc] unexpected pos"; safetensors: no file named), so look at the disk;
    # an interrupt stays one whatever the disk.
    full = isinstance(e, Exception) and no_space_left(path.parent)
    if write:
        shutil.rmtree(staging, ignore_errors=True)
        _OPEN.discard(staging)
    if full or isinstance(e, OSError) or isinstance(e, Exception) and "No space left" in str(e):
        why = f"no space left on the device holding {path.parent}" if full else "saving the checkpoint failed"
        raise ArtifactError(f"{path}: {why} ({type(e).__name__}: {e}); the previous checkpoint, if any, is "
                            "untouched: free space (`rlpipe prune RUN`, a smaller `keep:`) or choose another "
                            "output, then rerun") from e
    raise e
