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
there, naming the artifact. A `detached` save writes bytes it owns (a policy's host snapshot),
so the optimize stage, which changes the engine's tensors, need not wait for it: it waits until
at most one detached save is left (`detached_in_flight`), so a disk slower than the iteration
holds back training instead of piling up snapshots in host memory. The thread is not a daemon: an
interpreter that exits with a save pending finishes it first.

Process-wide state: one object per process, `BACKGROUND` (a `BackgroundSaves`), owned by this
module: whether background saves are allowed, the save threads not yet waited for and the failures
not yet reported. `BACKGROUND.reset()` waits for every save in flight (reporting a failure on
stderr) and disallows background saves again, as in a fresh process; tests reset it with every
other process-wide object through `process_state.reset_process_state()`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

_log = logging.getLogger(__name__)


class BackgroundSaves:
    """This process's background saves (see the module doc)."""

    def __init__(self) -> None:
        self.allowed = False
        """Whether this process waits for what stages write in the background (`allow_background`)."""
        self.pending: list[threading.Thread] = []
        """The save threads not yet waited for, in the order they were handed over."""
        self.detached: set[threading.Thread] = set()
        """Those of `pending` whose saves own what they write (`in_background`'s `detached`)."""
        self.failed: list[tuple[str, BaseException]] = []
        """(artifact, error) of the saves that failed, until a `wait_for_background` reports them."""
        self.on_failure: list[Callable[[str, BaseException], None]] = []
        """Told of each failed save as it fails (a resident worker tells its driver, which may be
        waiting for that artifact's manifest: cluster/worker.py)."""

    def reset(self) -> None:
        """Wait for every save in flight (failures reported on stderr, not raised), then allow
        none and tell no one: the state of a fresh process."""
        wait_for_background(raise_errors=False)
        self.allowed = False
        self.on_failure.clear()


#: This process's background saves (see the module doc).
BACKGROUND = BackgroundSaves()


def allow_background(allowed: bool = True) -> None:
    """This process waits for what stages write in the background (see the module doc)."""
    BACKGROUND.allowed = allowed


def background_allowed() -> bool:
    return BACKGROUND.allowed


def in_background(save: Callable[[], None], what: str, *, detached: bool = False) -> None:
    """Run `save` (writing the artifact `what`) in a thread, once the saves handed over before it
    are done (without waiting for them here); where background saves are not allowed, now.
    `detached`: `save` reads only bytes it owns, nothing its caller changes afterwards."""
    if not BACKGROUND.allowed:
        wait_for_background()
        save()
        return
    before = BACKGROUND.pending[-1] if BACKGROUND.pending else None

    def target() -> None:
        if before is not None:
            before.join()
        try:
            save()
        except BaseException as e:  # raised by the next wait_for_background; said at once
            BACKGROUND.failed.append((what, e))
            _log.error(f"writing {what} in the background failed ({type(e).__name__}: "
                       f"{(str(e).splitlines() or [''])[0][:300]})")
            for tell in list(BACKGROUND.on_failure):
                try:
                    tell(what, e)
                except Exception as told:  # noqa: BLE001 (the failure itself is raised later anyway)
                    _log.error(f"could not report that failure ({told})")

    thread = threading.Thread(target=target, name=f"rlpipe-save {what}")
    thread.start()
    BACKGROUND.pending.append(thread)
    if detached:
        BACKGROUND.detached.add(thread)


def wait_for_background(*, raise_errors: bool = True, detached_in_flight: int = 0) -> float:
    """Wait for every pending save but the last `detached_in_flight` ones where those are detached
    (saves finish in order: whatever came before them is waited for); returns the seconds waited. A
    save that failed raises here (or, with `raise_errors` False, is reported on stderr: an error is
    already on its way)."""
    started = time.perf_counter()
    pending = BACKGROUND.pending
    while pending and (len(pending) > detached_in_flight or not BACKGROUND.detached.issuperset(pending)
                       or not pending[0].is_alive()):
        thread = pending.pop(0)
        thread.join()
        BACKGROUND.detached.discard(thread)
    from rlpipe.schemas.errors import ArtifactError, UserError

    while BACKGROUND.failed:
        what, e = BACKGROUND.failed.pop(0)
        if raise_errors:
            message = f"writing {what} in the background failed: {type(e).__name__}: {e}"
            raise (ArtifactError(message) if isinstance(e, UserError) else RuntimeError(message)) from e
        _log.error(f"writing {what} in the background failed: {type(e).__name__}: {e}")
    return time.perf_counter() - started
