"""Artifacts written in the background: a stage hands a save to a thread and returns, so the save
overlaps what runs next (optimize's train state, written while the next rollout samples).

Only in a process that will wait for it: one running a pipeline (the runner, a resident worker),
which calls `allow_background()`. Everywhere else (a stage's command line, a direct `run(config)`)
a stage returns with all its outputs written, as it always did.

Saves run one after another in the order they were handed over (each thread first waits for the
one before it), and the caller never waits: optimize hands over the policy's files and then the
train state, and returns at once.

The artifact is staged and its manifest written last, as any other, so a process killed mid-save
leaves nothing complete-looking and the rerun recomputes it. Whoever reads it next in this
process waits first (`wait_for_background`: the optimize stage, before anything else; the
pipeline at the end of a run; a resident worker before it leaves), and a failed save is raised
there, naming the artifact. The thread is not a daemon: an interpreter that exits with a save
pending finishes it first.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

_PENDING: list[threading.Thread] = []
_FAILED: list[tuple[str, BaseException]] = []
_ALLOWED = [False]


def allow_background(allowed: bool = True) -> None:
    """This process waits for what stages write in the background (see the module doc)."""
    _ALLOWED[0] = allowed


def background_allowed() -> bool:
    return _ALLOWED[0]


def in_background(save: Callable[[], None], what: str) -> None:
    """Run `save` (writing the artifact `what`) in a thread, once the saves handed over before it
    are done (without waiting for them here); where background saves are not allowed, now."""
    if not _ALLOWED[0]:
        wait_for_background()
        save()
        return
    before = _PENDING[-1] if _PENDING else None

    def target() -> None:
        if before is not None:
            before.join()
        try:
            save()
        except BaseException as e:  # reported by the next wait_for_background
            _FAILED.append((what, e))

    thread = threading.Thread(target=target, name=f"rlpipe-save {what}")
    thread.start()
    _PENDING.append(thread)


def wait_for_background(*, raise_errors: bool = True) -> float:
    """Wait for every pending save; returns the seconds waited. A save that failed raises here
    (or, with `raise_errors` False, is reported on stderr: an error is already on its way)."""
    started = time.perf_counter()
    while _PENDING:
        _PENDING.pop(0).join()
    from rlpipe.schemas.errors import ArtifactError, UserError

    while _FAILED:
        what, e = _FAILED.pop(0)
        if raise_errors:
            message = f"writing {what} in the background failed: {type(e).__name__}: {e}"
            raise (ArtifactError(message) if isinstance(e, UserError) else RuntimeError(message)) from e
        print(f"rlpipe: writing {what} in the background failed: {type(e).__name__}: {e}", file=sys.stderr)
    return time.perf_counter() - started
