"""A real two-node Slurm cluster on this machine (`rlpipe.cluster.netns_cluster`): each node a
network, UTS and mount namespace with its own host name, address on a private bridge and /tmp.

What is checked here is the cluster itself, which the multi-node runs stand on: a 2-node job's
steps run one per node, each with its own host name, address, /tmp and processes, and see the
shared folders;
a 2-node torchrun job rendezvouses at node 0's address and all-reduces over gloo across the
bridge; and the cluster leaves nothing behind (no namespace, link or process)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rlpipe.cluster.netns_cluster import node_processes

pytestmark = [pytest.mark.multinode, pytest.mark.slurm, pytest.mark.slow]

ALL_REDUCE = """
import socket, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print("rank", dist.get_rank(), "of", dist.get_world_size(), "on", socket.gethostname(), "sum", float(t), flush=True)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def two_nodes():
    from rlpipe.cluster import netns_cluster, slurm_local

    if os.geteuid() != 0:
        pytest.skip("a cluster of namespaces needs root")
    state = Path(tempfile.mkdtemp(prefix="rlpipe-nodes-"))  # (under /tmp: bound into every node's own /tmp)
    shared = Path(tempfile.mkdtemp(prefix="rlpipe-shared-"))
    shared.chmod(0o755)
    # (the repository and the interpreter's environment too, where they lie under /tmp: a clean
    # clone there would be hidden by each node's own /tmp)
    repository = Path(__file__).resolve().parents[2]
    cluster = netns_cluster.NodeCluster(state, 2, shared=[shared, repository, Path(sys.prefix)])
    try:
        cluster.up()
    except slurm_local.SlurmUnavailable as e:
        cluster.down()
        pytest.skip(str(e))
    try:
        yield cluster, shared
    finally:
        cluster.down()
        assert cluster.leftovers() == []
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(shared, ignore_errors=True)


def _batch(cluster, shared: Path, name: str, script: str, timeout: float = 120.0) -> str:
    """Run `script` as a 2-node batch job; its output."""
    job, out = shared / f"{name}.sh", shared / f"{name}.out"
    job.write_text("#!/bin/sh\n" + script)
    done = subprocess.run(["sbatch", "--parsable", "-N2", "-o", str(out), str(job)], env=cluster.env,
                          capture_output=True, text=True, check=True)
    job_id = done.stdout.strip()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "-h", "-j", job_id], env=cluster.env, capture_output=True, text=True)
        if not queued.stdout.strip():
            return out.read_text() if out.exists() else ""
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], env=cluster.env)
    raise AssertionError(f"job {name} did not end within {timeout:.0f} s: {out.read_text() if out.exists() else ''}")


def test_each_node_has_its_own_name_address_and_tmp(two_nodes):
    cluster, shared = two_nodes
    (Path("/tmp") / "rlpipe-on-the-host").write_text("host")
    (shared / "marker").write_text("seen")
    try:
        out = _batch(cluster, shared, "nodes", (
            "srun -N2 --ntasks-per-node=1 sh -c 'echo node $(hostname) $SLURM_NODEID "
            "$(ip -4 -o addr show eth0 | awk \"{print \\$4}\") "
            f"host-tmp=$(test -e /tmp/rlpipe-on-the-host && echo seen || echo own) shared=$(cat {shared}/marker) "
            "init=$(cat /proc/1/comm)'\n"))
    finally:
        (Path("/tmp") / "rlpipe-on-the-host").unlink()
    lines = sorted(line.split()[1:] for line in out.splitlines() if line.startswith("node "))
    # (pid 1 of a node is its slurmd: its processes are a pid namespace of their own)
    assert lines == [["node0", "0", "10.213.7.1/24", "host-tmp=own", "shared=seen", "init=slurmd"],
                     ["node1", "1", "10.213.7.2/24", "host-tmp=own", "shared=seen", "init=slurmd"]], out


def test_a_two_node_torchrun_job_all_reduces_across_the_bridge(two_nodes):
    cluster, shared = two_nodes
    (shared / "all_reduce.py").write_text(ALL_REDUCE)
    torchrun = Path(sys.executable).with_name("torchrun")
    out = _batch(cluster, shared, "torchrun", (
        "export GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1\n"
        f"srun -N2 --ntasks-per-node=1 {torchrun} --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d "
        f"--rdzv_endpoint 10.213.7.1:29500 --rdzv_id all_reduce {shared / 'all_reduce.py'}\n"), timeout=180)
    ranks = sorted(line for line in out.splitlines() if line.startswith("rank "))
    assert ranks == ["rank 0 of 2 on node0 sum 3.0", "rank 1 of 2 on node1 sum 3.0"], out


#: Rollout on 2 workers (one per node), optimize on 2 ranks (one per node, a 2-node torchrun-style
#: step meeting at node 0's address); the driver in the batch step on node 0.
ACROSS = {"rollout": {"workers": 2}, "optimize": {"nodes": 2, "ranks_per_node": 1}}


def test_a_two_node_run_equals_the_in_process_run(two_nodes, launched_preset, assert_like_in_process):
    cluster, shared = two_nodes
    preset = launched_preset(shared / "mini.yaml", ACROSS)
    run_dir = shared / "runs" / "mini"
    done = subprocess.run([sys.executable, "-m", "rlpipe.pipelines.cli", "submit", "slurm", str(preset), "--nodes", "2",
                           "--run-dir", str(run_dir), "--time", "00:10:00", "--wait"],
                          env={**cluster.env, "OMP_NUM_THREADS": "1"}, cwd=shared, capture_output=True, text=True,
                          timeout=600)
    driver = sorted((run_dir / "logs").glob("driver-*.out"))
    log = driver[0].read_text() if driver else "<no driver log>"
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{log}"
    assert "on 2 node(s): node[0-1]" in log and "iter   2/2" in log
    assert_like_in_process(run_dir)
    # one member of each group per node, each in its node's own processes
    members = {(stage, m): (run_dir / "logs" / "workers" / f"{stage}.{m}.log").read_text()
               for stage in ("rollout", "optimize") for m in (0, 1)}
    hosts = {key: set(re.findall(r"on host (node\d)", text)) for key, text in members.items()}
    assert {frozenset(hosts[(s, 0)] | hosts[(s, 1)]) for s in ("rollout", "optimize")} == {frozenset({"node0", "node1"})}, hosts
    # the policy reached the member on the other node over the bridge (gloo), not shared memory
    sent = [line for p in run_dir.glob("logs/iter_*/optimize*.log") for line in p.read_text().splitlines()
            if "weight channel] sent policy" in line]
    assert sent and not any("(shared memory)" in line for line in sent), sent


def test_members_on_node_1_leave_when_the_driver_on_node_0_falls_silent(two_nodes, launched_preset):
    """The heartbeat path: the driver (the batch step on node 0) stopped mid-run, so Slurm still
    holds the job; the members on node 1, which cannot see its process, leave once its heartbeat
    has not changed for `launch.driver_timeout_s`; those on node 0 watch its (living) process."""
    import signal

    import yaml

    cluster, shared = two_nodes
    preset = launched_preset(shared / "long.yaml", {**ACROSS, "driver_timeout_s": 6})
    preset.write_text(yaml.safe_dump({**yaml.safe_load(preset.read_text()), "iterations": 40}))
    run_dir = shared / "runs" / "long"
    done = subprocess.run([sys.executable, "-m", "rlpipe.pipelines.cli", "submit", "slurm", str(preset), "--nodes", "2",
                           "--run-dir", str(run_dir), "--time", "00:10:00"],
                          env={**cluster.env, "OMP_NUM_THREADS": "1"}, cwd=shared, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    job = re.search(r"submitted job (\d+)", done.stdout).group(1)
    worker = "rlpipe.cluster.worker"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (node_processes(1, worker) and (run_dir / "iter_0001").exists()):
        time.sleep(0.5)
    on_node_1 = node_processes(1, worker)
    assert on_node_1, "no member started on node 1"
    driver = node_processes(0, f"--run-dir {run_dir}")
    assert len(driver) == 1, driver
    os.kill(driver[0], signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        while time.monotonic() - stopped < 6 + 20 and node_processes(1, worker):
            time.sleep(0.5)
        left_after = time.monotonic() - stopped
        assert not node_processes(1, worker), "members on node 1 outlived the driver's heartbeat"
        assert left_after >= 6 * 0.8, left_after  # (not before the timeout: the driver was alive until then)
        assert node_processes(0, worker), "members on node 0 left though the driver's process lives"
        said = "".join(p.read_text() for p in (run_dir / "logs" / "workers").glob("*.log"))
        assert "sent no heartbeat for 6 s: leaving" in said
    finally:
        os.kill(driver[0], signal.SIGKILL)
        subprocess.run(["scancel", job], env=cluster.env)  # (it ends with its batch step anyway)


@pytest.mark.prefect_server
def test_the_prefect_launcher_runs_stages_on_a_worker_on_node_1(two_nodes, launched_preset, assert_like_in_process):
    """A Prefect server on node 0, the run's flow on a worker there, and rollout and optimize
    routed to a work pool whose one worker is on node 1 (launcher prefect): the stages' resident
    members run on node 1, talking to the server and the driver across the bridge, and the run
    equals the in-process one."""
    import json
    import signal
    import urllib.request

    from rlpipe.cluster.netns_cluster import address

    cluster, shared = two_nodes
    api = f"http://{address(0)}:4200/api"
    env = {**cluster.env, "PREFECT_HOME": "/tmp/prefect", "PREFECT_API_URL": api,  # (each node's own /tmp)
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false", "OMP_NUM_THREADS": "1"}
    prefect = f"{sys.executable} -m prefect"
    home = shared / "prefect"
    home.mkdir()
    run_dir = home / "runs" / "mini"  # (the run's name is a column of its artifacts)
    launch = {"launcher": "prefect", "rollout": {"workers": 1, "work_pool": "rlpipe-stages"},
              "optimize": {"ranks_per_node": 1, "work_pool": "rlpipe-stages"}}
    preset = launched_preset(home / "mini.yaml", launch)
    started = []

    def on(i: int, command: str) -> None:
        done = cluster.run_on(i, f"cd {home} && {command}", env=env, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr

    def health() -> bool:
        try:
            with urllib.request.urlopen(f"{api}/health", timeout=5) as answer:
                return json.loads(answer.read()) is True
        except OSError:
            return False

    try:
        started.append(cluster.start(0, f"{prefect} server start --host {address(0)} --port 4200", "prefect-server",
                                     env=env))
        deadline = time.monotonic() + 120
        while not health():
            assert started[0].poll() is None and time.monotonic() < deadline, \
                (cluster.state / "log" / "prefect-server.out").read_text()[-3000:]
            time.sleep(0.5)
        for pool in ("rlpipe-driver", "rlpipe-stages"):
            on(0, f"{prefect} work-pool create {pool} --type process")
        on(0, f"{sys.executable} -m rlpipe.flows.deploy --pool rlpipe-driver --name mini --stage-pool rlpipe-stages "
              f"--preset {preset} --run-dir {run_dir}")
        # (Prefect workers ignore SIGTERM while they run flows: SIGINT stops them)
        started.append(cluster.start(0, f"{prefect} worker start --pool rlpipe-driver", "prefect-driver", env=env))
        started.append(cluster.start(1, f"{prefect} worker start --pool rlpipe-stages", "prefect-stages", env=env))
        done = cluster.run_on(0, f"cd {home} && {prefect} deployment run rlpipe-run/mini --watch --watch-timeout 300",
                              env=env, timeout=360)
        logs = "".join((cluster.state / "log" / f"prefect-{w}.out").read_text()[-3000:] for w in ("driver", "stages"))
        assert done.returncode == 0 and "Completed" in done.stdout, done.stdout + done.stderr + logs
        assert_like_in_process(run_dir)
        members = {stage: "".join(p.read_text() for p in (run_dir / "logs" / "workers").glob(f"{stage}*.log"))
                   for stage in ("rollout", "optimize")}
        assert all(set(re.findall(r"on host (node\d)", text)) == {"node1"} for text in members.values()), members
    finally:
        for proc in reversed(started):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT if proc is not started[0] else signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def test_a_node_lost_mid_run_ends_it_in_one_error_and_the_same_command_resumes(
        two_nodes, launched_preset, assert_like_in_process):
    """Node 1 lost during iteration 2's optimize (one rank held there by a test hook, the other
    waiting for it in a collective; then every process of node 1 killed and its link down): the
    driver finds node 1's rank silent within `launch.driver_timeout_s` and ends the run with one
    paragraph naming the stage and the node (exit 3; not retried: the allocation lost the node),
    and the steps on node 0 end with it. Node 1 back, the same command resumes to the in-process
    run's artifacts."""
    cluster, shared = two_nodes
    preset = launched_preset(shared / "loss.yaml", {**ACROSS, "driver_timeout_s": 6})
    run_dir = shared / "runs" / "mini"  # (the run's name is a column of its artifacts)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "rlpipe.pipelines.cli", "submit", "slurm", str(preset), "--nodes", "2",
           "--run-dir", str(run_dir), "--time", "00:10:00", "--wait"]
    env = {**cluster.env, "OMP_NUM_THREADS": "1"}
    hold = shared / "held"
    tests = Path(__file__).resolve().parents[1]
    paused = {"PYTHONPATH": f"{tests}{os.pathsep}{tests / 'cluster' / 'worker_hooks'}",
              "RLPIPE_TEST_WORKER_PAUSE": "rlpipe.stages.optimize.run:run@2", "RLPIPE_TEST_WORKER_PAUSE_FILE": str(hold)}
    run = subprocess.Popen(cmd, env={**env, **paused}, cwd=shared, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (hold.is_file() and hold.read_text()) and run.poll() is None:
        time.sleep(0.5)
    assert hold.is_file() and run.poll() is None, "no optimize rank held in iteration 2"
    lost_at = time.monotonic()
    cluster.lose(1)
    out, _ = run.communicate(timeout=180)
    ended_after = time.monotonic() - lost_at
    log = "".join(p.read_text() for p in sorted((run_dir / "logs").glob("driver-*.out")))
    assert run.returncode != 0 and ended_after < 6 + 90, (ended_after, out)
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in log, log[-3000:]
    assert "stage optimize" in errors[0] and "on host node1 sent no heartbeat for 6 s" in errors[0], errors
    assert "retrying" not in log
    assert not node_processes(0, "rlpipe.cluster.worker")  # the steps on node 0 ended with the run
    cluster.restore(1)
    again = subprocess.run(cmd, env=env, cwd=shared, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert_like_in_process(run_dir)


def test_a_lost_node_is_gone_and_the_other_goes_on(two_nodes):
    """`lose(1)`: every process in node 1's namespace killed and its link down: node 0 no longer
    reaches it; node 0 still runs a job. (Last in this module: the cluster then has one node.)"""
    cluster, _ = two_nodes
    reach = "timeout 3 bash -c 'echo > /dev/tcp/10.213.7.2/6818' 2>/dev/null && echo reached || echo lost"
    assert cluster.run_on(0, reach).stdout.strip() == "reached"  # (node 1's slurmd)
    cluster.lose(1)
    assert cluster.run_on(0, reach).stdout.strip() == "lost"
    alone = subprocess.run(["srun", "-N1", "-w", "node0", "hostname"], env=cluster.env, capture_output=True, text=True,
                           timeout=60)
    assert alone.stdout.strip() == "node0", alone.stdout + alone.stderr
