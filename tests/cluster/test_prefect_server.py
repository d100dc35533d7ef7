"""A real Prefect server on 127.0.0.1 with a process work pool and a worker: a deployment of a
2-iteration preset (`rlpipe.flows.deploy`) runs to completion, and its per-iteration tables are
Prefect artifacts readable from the server's API."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rlpipe.cluster.launchers import LOOPBACK, free_port

#: The Prefect command line of this interpreter (its `prefect` script may live in another venv).
PREFECT = [sys.executable, "-m", "prefect"]


def _api(url: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read() or b"null")


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.prefect_server
@pytest.mark.slow
def test_a_deployment_runs_on_a_real_server_and_worker(tmp_path, launched_preset):
    port = free_port()
    api = f"http://{LOOPBACK}:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": api,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false",
           "OMP_NUM_THREADS": "1"}
    procs: list[tuple[subprocess.Popen, int]] = []
    try:
        server = _start([*PREFECT, "server", "start", "--host", LOOPBACK, "--port", str(port)],
                        env, tmp_path / "server.log")
        procs.append((server, signal.SIGTERM))
        deadline = time.time() + 90
        while True:
            try:
                if _api(f"{api}/health") is True:
                    break
            except OSError:
                pass
            assert server.poll() is None and time.time() < deadline, (tmp_path / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        run = lambda *argv: subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)  # noqa: E731
        done = run(*PREFECT, "work-pool", "create", "rlpipe-test", "--type", "process")
        assert done.returncode == 0, done.stdout + done.stderr
        run_dir = tmp_path / "runs" / "mini"
        done = run(sys.executable, "-m", "rlpipe.flows.deploy", "--pool", "rlpipe-test", "--name", "mini",
                   "--preset", str(launched_preset(tmp_path / "mini.yaml")), "--run-dir", str(run_dir))
        assert done.returncode == 0, done.stdout + done.stderr
        # The worker ignores SIGTERM while it runs flows: stop it with SIGINT.
        procs.append((_start([*PREFECT, "worker", "start", "--pool", "rlpipe-test"], env,
                             tmp_path / "worker.log"), signal.SIGINT))
        done = run(*PREFECT, "deployment", "run", "rlpipe-run/mini", "--watch",
                   "--watch-timeout", "110")
        worker_log = (tmp_path / "worker.log").read_text()[-4000:]
        assert done.returncode == 0 and "Completed" in done.stdout, done.stdout + done.stderr + worker_log

        arts = _api(f"{api}/artifacts/filter", {"artifacts": {"key": {"any_": ["mini-iter-0000", "mini-iter-0001"]}}})
        by_key = {a["key"]: a["data"] for a in arts}
        assert sorted(by_key) == ["mini-iter-0000", "mini-iter-0001"]
        for k, table in enumerate((by_key["mini-iter-0000"], by_key["mini-iter-0001"])):
            assert f"### mini: iteration {k + 1}" in table and "| reward_mean |" in table
        assert (run_dir / "iter_0001" / "policy" / "_manifest.json").is_file()
    finally:
        for proc, sig in reversed(procs):
            _stop(proc, sig)
