"""Test-only: pause a function inside any process started with this folder on PYTHONPATH (a
resident worker, a torchrun rank), so a test can SIGKILL that process exactly there. Nothing in
rlpipe reads these variables.

RLPIPE_TEST_WORKER_PAUSE='package.module:attribute@N': the N-th call of that function in a process
writes the process's pid to $RLPIPE_TEST_WORKER_PAUSE_FILE (created once: the first process to get
there holds) and sleeps. RLPIPE_TEST_WORKER_FAIL='package.module:attribute@N': the N-th call raises
OSError 28 (no space left on device) instead. The module is patched as it is imported, so a process
that never imports it pays nothing.
"""

import importlib.abc
import os
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # tests/: the one hold (resident_hooks)
from resident_hooks import hold_once  # noqa: E402


def _pause(module, attr: str, nth: int, pause_file: str) -> None:
    real, calls = getattr(module, attr), [0]

    def paused(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            if pause_file == "disk-full":  # (RLPIPE_TEST_WORKER_FAIL: the call fails as on a full disk)
                raise OSError(28, "No space left on device")
            hold_once(pause_file)
        return real(*args, **kwargs)

    setattr(module, attr, paused)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, module: str, attr: str, nth: int, pause_file: str):
        self.module, self.args = module, (attr, nth, pause_file)

    def find_spec(self, name, path, target=None):
        if name != self.module:
            return None
        for finder in sys.meta_path:
            found = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if found is not None:
                break
        else:
            return None
        run = found.loader.exec_module

        def exec_module(module):
            run(module)
            _pause(module, *self.args)

        found.loader.exec_module = exec_module
        return found


_spec = os.environ.get("RLPIPE_TEST_WORKER_PAUSE")
if _spec:
    _ref, _, _nth = _spec.partition("@")
    _module, _, _attr = _ref.partition(":")
    sys.meta_path.insert(0, _PatchOnImport(_module, _attr, int(_nth or 1), os.environ["RLPIPE_TEST_WORKER_PAUSE_FILE"]))
_spec = os.environ.get("RLPIPE_TEST_WORKER_FAIL")
if _spec:
    _ref, _, _nth = _spec.partition("@")
    _module, _, _attr = _ref.partition(":")
    sys.meta_path.insert(0, _PatchOnImport(_module, _attr, int(_nth or 1), "disk-full"))
