"""Test-only launcher of `rlpipe` for kill points (nothing in rlpipe reads its variables).

A pause: RLPIPE_TEST_PAUSE='package.module:attribute@N' makes the N-th call of that function
touch $RLPIPE_TEST_PAUSE_FILE and sleep there, so the test's SIGKILL lands exactly at that call.

A zygote (`pause_driver.py --zygote`): imports rlpipe, torch, transformers and DeepSpeed once, then
for each JSON request on stdin ({"argv": [...], "env": {...}, "log": path}) forks a child that runs
`rlpipe <argv>` from scratch (nothing has run in the parent: no model, cache or process group) and
answers {"pid": ...} at once and {"exit": code} when the child ends. The test SIGKILLs the child:
a resumed segment then costs no interpreter start-up and imports (about 8 s of CPU each).
"""

import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path


def _install_pause() -> None:
    spec = os.environ.get("RLPIPE_TEST_PAUSE")
    if not spec:
        return
    ref, _, nth = spec.partition("@")
    module_name, _, attr = ref.partition(":")
    module = importlib.import_module(module_name)
    real = getattr(module, attr)
    calls = [0]

    def paused(*args, **kwargs):
        calls[0] += 1
        if calls[0] == int(nth or 1):
            Path(os.environ["RLPIPE_TEST_PAUSE_FILE"]).touch()
            time.sleep(3600)
        return real(*args, **kwargs)

    setattr(module, attr, paused)


def _rlpipe(argv: list[str]) -> int:
    from rlpipe.pipelines.cli import main

    sys.argv = ["rlpipe", *argv]
    try:
        main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def _zygote() -> None:
    import rlpipe.pipelines.cli  # noqa: F401
    import rlpipe.pipelines.runner  # noqa: F401
    from rlpipe.stages import STAGES
    from rlpipe.stages.common.deepspeed import import_deepspeed

    for name in STAGES:
        importlib.import_module(f"rlpipe.stages.{name}.run")
    import_deepspeed()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the child: one `rlpipe` run
            code = 1
            try:
                fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.environ.update(request.get("env", {}))
                signal.signal(signal.SIGINT, signal.default_int_handler)
                _install_pause()
                code = _rlpipe(request["argv"])
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        _zygote()
    else:
        _install_pause()
        sys.exit(_rlpipe(sys.argv[1:]))
