"""SIGINT and SIGTERM: stop with a one-line message, leave nothing partial, exit 130 / 143.

The handler raises `Interrupted`, a BaseException (so no `except Exception` in a stage or in user
code swallows it). It unwinds like any error: artifacts and checkpoints are written in staging
directories and swapped in only when complete (rlpipe.schemas.staging), so what was finished stays
and what was not is removed; rerunning the same command resumes.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator


class Interrupted(BaseException):
    """The process received SIGINT or SIGTERM."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} received")

    @property
    def exit_code(self) -> int:
        """128 + the signal number: 130 for SIGINT, 143 for SIGTERM (the shell convention)."""
        return 128 + self.signum


def _raise(signum: int, frame: object) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def exit_on_signals(what: str) -> Iterator[None]:
    """Turn SIGINT / SIGTERM inside the block into a message on stderr and SystemExit(130 / 143)."""
    from rlpipe.schemas.staging import discard_open_staging

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except Interrupted as e:
        for s in previous:  # a second signal during clean-up must not interrupt it
            signal.signal(s, signal.SIG_IGN)
        discard_open_staging()
        print(f"rlpipe: {signal.Signals(e.signum).name} received, stopped {what}; finished artifacts "
              "are kept and nothing partial was left: rerun the same command to resume",
              file=sys.stderr, flush=True)
        raise SystemExit(e.exit_code) from None
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
