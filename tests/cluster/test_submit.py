"""Rendering Slurm / Kubernetes jobs for a stage, and (slow) a real one-node Slurm cluster running
a rendered 2-rank gloo all-reduce job."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import yaml

from rlpipe.cluster.launch import free_port
from rlpipe.cluster.submit import JobSpec, main, module_for, render_k8s, render_slurm


def test_module_names():
    assert module_for("optimize") == "rlpipe.stages.optimize"
    assert module_for("reference") == "rlpipe.stages.reference"
    assert module_for("smoke") == "rlpipe.cluster.smoke"
    with pytest.raises(ValueError, match="unknown stage 'optimise'"):
        JobSpec(stage="optimise")


def test_slurm_srun_script(tmp_path):
    text = render_slurm(JobSpec(stage="optimize", args=("-c", "/cfg/a b.yaml", "lr=1e-6"), nodes=2,
                                gpus_per_node=8, workdir="/shared/rl", python="/venv/bin/python",
                                partition="gpu"))
    lines = text.splitlines()
    for want in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "cd /shared/rl"):
        assert want in lines, want
    assert 'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in lines
    assert "RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID" in text
    assert "/venv/bin/python -m rlpipe.stages.optimize -c '/cfg/a b.yaml' lr=1e-6" in text
    assert "DS_ACCELERATOR" not in text  # GPUs: DeepSpeed picks CUDA
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0  # valid shell


def test_slurm_torchrun_and_cpu_variants():
    text = render_slurm(JobSpec(stage="sft", nodes=3, ranks_per_node=4, cpus_per_task=2, launcher="torchrun"))
    assert "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --cpus-per-task=8" in text
    assert "torchrun --nnodes $SLURM_JOB_NUM_NODES --nproc_per_node 4 --node_rank $SLURM_NODEID" in text
    assert "-m rlpipe.stages.sft" in text
    assert "export DS_ACCELERATOR=cpu" in text and "export OMP_NUM_THREADS=2" in text
    assert "--gpus-per-node" not in text


def test_k8s_manifest():
    docs = list(yaml.safe_load_all(render_k8s(JobSpec(
        stage="optimize", args=("-c", "/runs/cfg.yaml"), nodes=2, gpus_per_node=8,
        image="reg/rlpipe:1", env={"NCCL_DEBUG": "INFO"}))))
    service, job = docs
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"  # headless (the string "None")
    assert job["kind"] == "Job" and job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == service["spec"]["selector"]["job-name"] == "rlpipe-optimize"
    (c,) = pod["containers"]
    assert c["image"] == "reg/rlpipe:1" and c["resources"]["limits"] == {"nvidia.com/gpu": 8}
    assert c["args"] == ["exec torchrun --nnodes 2 --nproc_per_node 8 --node_rank $JOB_COMPLETION_INDEX "
                         "--master_addr rlpipe-optimize-0.rlpipe-optimize --master_port 29500 "
                         "-m rlpipe.stages.optimize -c /runs/cfg.yaml"]
    assert {"name": "NCCL_DEBUG", "value": "INFO"} in c["env"]


def test_cli_prints_and_rejects(capsys, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("lr: 1.0e-6\n")
    assert main(["slurm", "--stage", "optimize", "--config", str(cfg), "--nodes", "2",
                 "--gpus-per-node", "8", "epochs=2"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=2" in out and f"-m rlpipe.stages.optimize -c {cfg} epochs=2" in out
    assert main(["k8s", "--stage", "nope"]) == 2



# A real one-node Slurm cluster: the `slurm_cluster` fixture (tests/cluster/conftest.py).
@pytest.mark.slurm
@pytest.mark.integration
@pytest.mark.slow
def test_real_slurm_runs_a_rendered_two_rank_job(slurm_cluster, tmp_path):
    """sbatch a rendered job: 2 Slurm tasks (ranks) on the one node all-reduce over gloo."""
    spec = JobSpec(stage="smoke", nodes=1, gpus_per_node=0, ranks_per_node=2, master_port=free_port(),
                   workdir=str(tmp_path), python=sys.executable, log_dir=str(tmp_path), time="00:05:00")
    script = tmp_path / "job.sbatch"
    script.write_text(render_slurm(spec))
    started = time.time()
    done = subprocess.run(["sbatch", "--wait", "--parsable", str(script)], env=slurm_cluster,
                          capture_output=True, text=True, timeout=300)
    log = next(tmp_path.glob("rlpipe-smoke-*.out"), None)
    text = log.read_text() if log else "<no job log>"
    assert done.returncode == 0, f"sbatch failed: {done.stderr}\n{text}"
    ok = sorted(line for line in text.splitlines() if line.startswith("rlpipe smoke: rank"))
    assert len(ok) == 2, text
    assert ok[0].startswith("rlpipe smoke: rank 0/2 local_rank 0") and ok[1].startswith("rlpipe smoke: rank 1/2 local_rank 1")
    assert all(line.endswith("all_reduce sum 3 (expected 3) OK") for line in ok)
    print(f"sbatch --wait of the 2-rank job: {time.time() - started:.1f} s")
