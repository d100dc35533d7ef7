"""Nothing is left in the temporary directory: after a run, after a failed run, and after a run
killed mid-way and rerun (libraries' own caches go to the user's cache directory instead:
stages.common.cli.own_cache_dirs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.reliability, pytest.mark.slow]


def _rlpipe(tmpdir: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmpdir), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # as a user's shell has it: unset
    return subprocess.Popen([sys.executable, "-m", "rlpipe.pipelines.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_runs_leave_nothing_in_the_temporary_directory(mini_preset_file, tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    run_dir = tmp_path / "runs" / "mini"
    argv = ("run", str(mini_preset_file), "--local", "--run-dir", str(run_dir))
    killed = _rlpipe(tmpdir, *argv)  # killed once iteration 0's policy is written
    deadline = time.monotonic() + 300
    while not (run_dir / "iter_0000" / "policy" / "_manifest.json").is_file():
        assert killed.poll() is None and time.monotonic() < deadline, killed.communicate()[0]
        time.sleep(0.01)
    killed.send_signal(signal.SIGKILL)
    killed.communicate()
    rerun = _rlpipe(tmpdir, *argv)
    assert rerun.wait(300) == 0, rerun.communicate()[0]
    # a run failing in its first iteration (its reward function raises)
    failed = _rlpipe(tmpdir, "run", str(mini_preset_file), "--local", "--run-dir", str(tmp_path / "runs" / "failed"),
                     "score.components=[{name: x, type: python, function: 'hostile_rewards:raises'}]")
    out = failed.communicate(timeout=300)[0]
    assert failed.returncode == 2 and "ZeroDivisionError" in out, out
    assert list(tmpdir.iterdir()) == []
