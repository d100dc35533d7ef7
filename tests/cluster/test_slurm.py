"""A whole run on a real one-node Slurm cluster: `rlpipe submit slurm` submits one allocation whose
batch step runs the driver and whose placed stages run as resident srun steps (one per stage for
the run, the default); the artifacts equal the in-process run's. The cluster comes from
`rlpipe.cluster.slurm_local` (the same as `make slurm-up`), which installs slurm-wlm and munge
from Debian's packages when they are missing."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

#: Rollout on 2 worker tasks, optimize on 2 ranks (srun tasks; rendezvous from the step's nodes).
PLACEMENT = {"rollout": {"workers": 2}, "optimize": {"nodes": 1, "ranks_per_node": 2}}


@pytest.mark.slurm
@pytest.mark.slow
def test_submit_slurm_runs_a_preset_as_one_allocation_with_srun_steps(
        slurm_cluster, tmp_path, launched_preset, assert_like_in_process):
    preset = launched_preset(tmp_path / "mini.yaml", PLACEMENT)
    run_dir = tmp_path / "runs" / "mini"
    done = subprocess.run([sys.executable, "-m", "rlpipe.pipelines.cli", "submit", "slurm", str(preset),
                           "--nodes", "1", "--run-dir", str(run_dir), "--time", "00:10:00", "--wait"],
                          env={**slurm_cluster, "OMP_NUM_THREADS": "1"}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    driver = sorted((run_dir / "logs").glob("driver-*.out"))
    log = driver[0].read_text() if driver else "<no driver log>"
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{log}"
    assert "finished job" in done.stdout and "iter   2/2" in log
    assert_like_in_process(run_dir)
    # the placed stages ran as one srun step each for the run (a task per member), the others in the driver
    workers = run_dir / "logs" / "workers"
    assert sorted(p.name for p in workers.iterdir()) == [
        "optimize.0.log", "optimize.1.log", "optimize.srun.log", "rollout.0.log", "rollout.1.log", "rollout.srun.log"]
    for stage in ("rollout", "optimize"):
        steps = re.findall(r"srun: .*|\[rlpipe worker [a-z]+\.\d\] pid \d+ on host \S+ serving", (workers / f"{stage}.0.log").read_text())
        assert len(steps) == 1, steps  # task 0 started once
        pids = {m: set(re.findall(rf"\[rlpipe worker {stage}\.{m}\] pid (\d+):",
                                  "".join(p.read_text() for p in run_dir.glob(f"logs/iter_*/{stage}*.log"))))
                for m in (0, 1)}
        assert all(len(p) == 1 for p in pids.values()), pids  # each member ran both iterations' orders
    logs = run_dir / "logs" / "iter_0001"
    assert sorted(p.name for p in logs.iterdir()) == ["optimize.log", "rollout.0.log", "rollout.1.log"]
    assert "rlpipe.stages.optimize" not in (logs / "rollout.0.log").read_text()
