"""User reward code, contained: a call that does not return within its timeout, or that ends the
process (`sys.exit`, KeyboardInterrupt), becomes an ordinary exception the scorer reports naming
the component; optionally every call runs in a worker process, so a crash or a hang in user code
cannot take the stage down with it.

`contain(fn, ...)` returns a function with `fn`'s signature: the scorer calls it exactly as it
would call `fn`.
"""

from __future__ import annotations

import functools
import importlib
import multiprocessing
import signal
import threading
import weakref
from collections.abc import Callable
from typing import Any


class UserCodeExit(Exception):
    """User code raised SystemExit or KeyboardInterrupt (it must return values, not end the run)."""


class UserCodeTimeout(Exception):
    """User code did not return within its timeout."""


class UserCodeCrash(Exception):
    """The worker process running user code died."""


class _Alarm(BaseException):
    """SIGALRM while user code runs (a BaseException: a user `except Exception` cannot keep it)."""


def _exit_error(e: BaseException) -> UserCodeExit:
    return UserCodeExit(f"{type(e).__name__}({', '.join(map(repr, e.args))}) inside a reward "
                        "function; it must return one value per row, not end the process")


def _timeout_error(timeout_s: float) -> UserCodeTimeout:
    return UserCodeTimeout(f"no result within {timeout_s:g} s (its timeout_s)")


def _guarded(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    try:
        return fn(*args, **kwargs)
    except (SystemExit, KeyboardInterrupt) as e:
        raise _exit_error(e) from None


def _in_process(fn: Callable[..., Any], timeout_s: float | None, args: tuple, kwargs: dict) -> Any:
    """Call `fn` here; past `timeout_s`, stop it (SIGALRM in the main thread, where Python code
    can be interrupted; elsewhere the call is abandoned in a daemon thread)."""
    if timeout_s is None:
        return _guarded(fn, args, kwargs)
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        def on_alarm(signum: int, frame: object) -> None:
            raise _Alarm

        previous = signal.signal(signal.SIGALRM, on_alarm)
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, timeout_s)
                return _guarded(fn, args, kwargs)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _Alarm:
            raise _timeout_error(timeout_s) from None
        finally:
            signal.signal(signal.SIGALRM, previous)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = _guarded(fn, args, kwargs)
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True, name="reward-function")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise _timeout_error(timeout_s)
    if "error" in box:
        raise box["error"]
    return box["value"]


def _serve(conn: Any, ref: str) -> None:
    """Worker process: import `ref` once, then answer (args, kwargs) requests until EOF."""
    module, _, attr = ref.partition(":")
    fn = getattr(importlib.import_module(module), attr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    while True:
        try:
            args, kwargs = conn.recv()
        except EOFError:
            return
        try:
            result = ("ok", list(_guarded(fn, args, kwargs)))
        except BaseException as e:
            result = ("error", e if _picklable(e) else RuntimeError(f"{type(e).__name__}: {e}"))
        conn.send(result)


def _picklable(e: BaseException) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return True
    except Exception:
        return False


class _Worker:
    """One spawned process serving calls of one user function; restarted after a kill."""

    def __init__(self, ref: str):
        self.ref = ref
        self.proc: Any = None
        self.conn: Any = None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, self.ref), daemon=True,
                                name=f"reward-function {self.ref}")
        self.proc.start()
        child.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
            self.conn.close()
            self.proc = self.conn = None

    def __call__(self, timeout_s: float | None, args: tuple, kwargs: dict) -> Any:
        if self.proc is None or not self.proc.is_alive():
            self.stop()
            self._start()
        self.conn.send((args, kwargs))
        if not self.conn.poll(timeout_s):
            self.stop()
            raise _timeout_error(timeout_s)
        try:
            status, value = self.conn.recv()
        except EOFError:
            self.proc.join()
            code = self.proc.exitcode
            self.stop()
            raise UserCodeCrash(f"the worker process running it died (exit code {code})") from None
        if status == "error":
            raise value
        return value


def contain(fn: Callable[..., Any], *, ref: str, timeout_s: float | None, isolate: bool) -> Callable[..., Any]:
    """`fn` with its calls contained (see the module doc).

    Args:
        ref: 'module:function', the import path of `fn` (imported again by a worker process).
        timeout_s: seconds one call may take; None for no limit.
        isolate: run every call in one worker process (spawned at the first call).
    """
    if isolate:
        worker = _Worker(ref)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            return worker(timeout_s, args, kwargs)

        weakref.finalize(call, worker.stop)
        return call

    @functools.wraps(fn)
    def call_here(*args: Any, **kwargs: Any) -> Any:
        return _in_process(fn, timeout_s, args, kwargs)

    return call_here
