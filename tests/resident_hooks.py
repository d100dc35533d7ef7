"""Test-only user code for the resident-worker tests: a `python` reward component that can hold a
worker mid-stage (nothing in rlpipe reads its variable).

With RLPIPE_TEST_HOLD=<file>, the first call in any process that creates <file> writes its pid
there and sleeps, silently: the test then SIGKILLs that worker mid-stage, or waits for the
driver's stall timeout. Otherwise it is an ordinary deterministic reward (length parity).
"""

from __future__ import annotations

import os
import time


def hold_once(hold_file: str) -> None:
    """The first process to get here creates `hold_file`, writes its pid there and sleeps (for the
    test to kill it there); any other goes on. (Also the pause of tests/cluster/worker_hooks.)"""
    try:
        fd = os.open(hold_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    time.sleep(3600)


def parity(prompts, responses, answers, **kwargs) -> list[float]:
    hold = os.environ.get("RLPIPE_TEST_HOLD")
    if hold:
        hold_once(hold)
    return [float(len(r) % 2) for r in responses]
