"""A real Prefect server on 127.0.0.1 with two process work pools and a worker each: a
deployment of a 2-iteration preset (`rlpipe.flows.deploy`) runs on one pool and routes two
placed stages to the other (launcher prefect) as resident groups (one long-lived flow run per
stage for the whole run), runs to completion with the artifacts of the in-process run, and its
per-iteration table is a Prefect artifact readable from the server's API."""

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

from rlpipe.cluster.launch import LOOPBACK, free_port

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
def test_a_deployment_runs_on_a_real_server_and_routes_stages_to_a_work_pool(tmp_path, launched_preset,
                                                                             assert_like_in_process):
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
        run = lambda *argv: subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=330)  # noqa: E731
        for pool in ("rlpipe-driver", "rlpipe-stages"):
            done = run(*PREFECT, "work-pool", "create", pool, "--type", "process")
            assert done.returncode == 0, done.stdout + done.stderr
        run_dir = tmp_path / "runs" / "mini"
        # Reference on 2 worker processes and optimize on 2 torchrun ranks, both on the stage pool.
        launch = {"launcher": "prefect", "reference": {"workers": 2, "work_pool": "rlpipe-stages"},
                  "optimize": {"ranks_per_node": 2, "work_pool": "rlpipe-stages"}}
        done = run(sys.executable, "-m", "rlpipe.flows.deploy", "--pool", "rlpipe-driver", "--name", "mini",
                   "--stage-pool", "rlpipe-stages", "--preset", str(launched_preset(tmp_path / "mini.yaml", launch)),
                   "--run-dir", str(run_dir))
        assert done.returncode == 0, done.stdout + done.stderr
        # The workers ignore SIGTERM while they run flows: stop them with SIGINT.
        for pool in ("rlpipe-driver", "rlpipe-stages"):
            procs.append((_start([*PREFECT, "worker", "start", "--pool", pool], env, tmp_path / f"{pool}.log"),
                          signal.SIGINT))
        done = run(*PREFECT, "deployment", "run", "rlpipe-run/mini", "--watch", "--watch-timeout", "300")
        logs = "".join((tmp_path / f"{pool}.log").read_text()[-3000:] for pool in ("rlpipe-driver", "rlpipe-stages"))
        assert done.returncode == 0 and "Completed" in done.stdout, done.stdout + done.stderr + logs

        # Reference and optimize each ran as one flow run of rlpipe-stage/rlpipe-stages serving
        # both iterations (a resident group), which ended when the run did.
        runs = _api(f"{api}/flow_runs/filter", {"work_pools": {"name": {"any_": ["rlpipe-stages"]}}})
        assert sorted(r["parameters"]["name"] for r in runs) == ["optimize", "reference"]
        assert all(r["parameters"]["worker_group"].startswith(str(run_dir / "workers")) for r in runs)
        assert all(r["state_type"] == "COMPLETED" for r in runs), [r["state_type"] for r in runs]
        for stage in ("reference", "optimize"):
            pids = {line.split(" pid ")[1].split(":")[0] for log in run_dir.glob(f"logs/iter_*/{stage}*.log")
                    for line in log.read_text().splitlines() if line.startswith(f"[rlpipe worker {stage}.0]")}
            assert len(pids) == 1, pids  # member 0 ran both iterations' orders
        assert_like_in_process(run_dir)

        from rlpipe.pipelines.report import run_table

        [table] = _api(f"{api}/artifacts/latest/filter", {"artifacts": {"key": {"any_": ["mini-iterations"]}}})
        assert json.loads(table["data"]) == run_table(run_dir).to_dicts() and run_table(run_dir).height == 2
    finally:
        for proc, sig in reversed(procs):
            _stop(proc, sig)
