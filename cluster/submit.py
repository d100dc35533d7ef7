"""Render, and optionally submit, a Slurm batch script or a Kubernetes Job that runs one stage on
N nodes x M ranks per node; and (`render_run_slurm`, `rlpipe submit slurm PRESET`) a whole run as
one allocation whose first node runs the driver and whose placed stages run as srun steps.

    python -m rlpipe.cluster.submit slurm --stage optimize --config cfg.yaml --nodes 2 --gpus-per-node 8
    python -m rlpipe.cluster.submit k8s --stage optimize --config /runs/cfg.yaml --nodes 2 \
        --gpus-per-node 8 --image registry/rlpipe:0.1 --pvc rlpipe-runs
    ... --submit            # sbatch / kubectl apply instead of printing
    python -m rlpipe.cluster.submit slurm --stage smoke --gpus-per-node 0 --ranks-per-node 2

Slurm, `--launcher srun` (default): one Slurm task per rank; each task sets RANK / WORLD_SIZE /
LOCAL_RANK from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and runs `python -m <stage>`.
`--launcher torchrun`: one task per node running torchrun with --node_rank $SLURM_NODEID.
MASTER_ADDR is the first host of the allocation in both. Kubernetes: an Indexed Job (one pod
per node, torchrun inside) plus a headless Service for the rendezvous.
The templates are `cluster/slurm/stage.sbatch` and `cluster/k8s/stage-job.yaml` (package data).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import string
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Literal

#: Extra runnable modules besides the stages: the cluster smoke test (a gloo all-reduce).
EXTRA_MODULES = {"smoke": "rlpipe.cluster.smoke"}


class _AtTemplate(string.Template):
    """`@{name}` placeholders: shell `${...}` and YAML stay untouched."""

    delimiter = "@"


@dataclass(frozen=True)
class JobSpec:
    """What to run and on how many ranks.

    Attributes:
        stage: a stage name (`rlpipe.stages.STAGES`) or 'smoke'.
        args: the stage's arguments (`-c cfg.yaml key=value ...`).
        nodes: N nodes (Slurm) / pods (Kubernetes).
        gpus_per_node: GPUs per node; 0 runs CPU ranks (gloo, DS_ACCELERATOR=cpu).
        ranks_per_node: M ranks per node (default: gpus_per_node, or 1 on CPU).
    """

    stage: str
    args: tuple[str, ...] = ()
    nodes: int = 1
    gpus_per_node: int = 0
    ranks_per_node: int | None = None
    job_name: str | None = None
    cpus_per_task: int | None = None
    master_port: int = 29500
    workdir: str = "."
    python: str = "python"
    env: dict[str, str] = field(default_factory=dict)
    # Slurm
    launcher: Literal["srun", "torchrun"] = "srun"
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    log_dir: str = "."
    # Kubernetes
    image: str = "rlpipe:latest"
    module: str | None = None
    """The module the pods run instead of the stage's (a resident group: rlpipe.cluster.worker)."""
    namespace: str = "default"
    pvc: str = "rlpipe-runs"
    runs_mount: str = "/runs"
    backoff_limit: int = 0

    def __post_init__(self) -> None:
        module_for(self.stage)
        if self.nodes < 1 or self.gpus_per_node < 0 or self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"bad topology: nodes={self.nodes} gpus_per_node={self.gpus_per_node} "
                             f"ranks_per_node={self.ranks_per_node}")

    @property
    def ranks(self) -> int:
        return self.ranks_per_node or self.gpus_per_node or 1

    @property
    def name(self) -> str:
        return self.job_name or f"rlpipe-{self.stage.replace('_', '-')}"

    @property
    def run_env(self) -> dict[str, str]:
        cpu = {} if self.gpus_per_node else {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
        threads = {"OMP_NUM_THREADS": str(self.cpus_per_task or 1)}
        return {**cpu, **threads, **self.env}


def module_for(stage: str) -> str:
    """The `python -m` module of a stage name (or 'smoke')."""
    from rlpipe.stages import STAGES

    if stage in EXTRA_MODULES:
        return EXTRA_MODULES[stage]
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; known: {sorted([*STAGES, *EXTRA_MODULES])}")
    return STAGES[stage].module


def _template(name: str) -> _AtTemplate:
    return _AtTemplate(resources.files("rlpipe.cluster").joinpath(name).read_text())


def render_slurm(spec: JobSpec) -> str:
    """The sbatch script for `spec` (see the module doc for the two launchers)."""
    module, args = module_for(spec.stage), shlex.join(spec.args)
    if spec.launcher == "srun":
        tasks, cpus = spec.ranks, spec.cpus_per_task or 1
        launch = (
            "srun --kill-on-bad-exit=1 bash -c 'export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS "
            "LOCAL_RANK=$SLURM_LOCALID LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE; exec \"$@\"' rank \\\n"
            f"    {shlex.quote(spec.python)} -m {module} {args}"
        )
    else:
        tasks, cpus = 1, (spec.cpus_per_task or 1) * spec.ranks
        launch = (
            "srun --kill-on-bad-exit=1 bash -c 'exec torchrun --nnodes $SLURM_JOB_NUM_NODES "
            f"--nproc_per_node {spec.ranks} --node_rank $SLURM_NODEID "
            "--master_addr $MASTER_ADDR --master_port $MASTER_PORT \"$@\"' rank \\\n"
            f"    -m {module} {args}"
        )
    extra = [f"#SBATCH --gpus-per-node={spec.gpus_per_node}"] if spec.gpus_per_node else []
    extra += [f"#SBATCH --partition={spec.partition}"] if spec.partition else []
    extra += [f"#SBATCH --account={spec.account}"] if spec.account else []
    return _template("slurm/stage.sbatch").substitute(
        stage=spec.stage, nodes=spec.nodes, ranks_per_node=spec.ranks, job_name=spec.name,
        tasks_per_node=tasks, cpus_per_task=cpus, time=spec.time, log_dir=spec.log_dir,
        sbatch_extra="\n".join(extra), master_port=spec.master_port,
        env="\n".join(f"export {k}={shlex.quote(v)}" for k, v in spec.run_env.items()),
        workdir=shlex.quote(spec.workdir), launch=launch,
    )


def render_k8s(spec: JobSpec) -> str:
    """The Service + Indexed Job manifest for `spec` (multi-document YAML)."""
    pad = " " * 12
    env = "\n".join(f"{pad}- {{name: {k}, value: {json.dumps(v)}}}" for k, v in spec.run_env.items())
    limits = (f"{pad}  nvidia.com/gpu: {spec.gpus_per_node}" if spec.gpus_per_node
              else f"{pad}  cpu: {spec.ranks * (spec.cpus_per_task or 1)}")
    return _template("k8s/stage-job.yaml").substitute(
        stage=spec.stage, nodes=spec.nodes, ranks_per_node=spec.ranks, job_name=spec.name,
        namespace=spec.namespace, master_port=spec.master_port, backoff_limit=spec.backoff_limit,
        image=spec.image, workdir=spec.workdir, module=spec.module or module_for(spec.stage), args=shlex.join(spec.args),
        env=env, limits=limits, runs_mount=spec.runs_mount, pvc=spec.pvc,
    )


def write_run_preset(preset, run_dir: Path, launcher: str) -> Path:
    """The preset a submitted driver runs: `preset` with `launch.launcher` set, validated and
    written to <run_dir>/submit/preset.yaml (a path every node reads on the shared filesystem)."""
    import yaml

    data = preset.model_dump(mode="json")
    data["launch"] = {**data["launch"], "launcher": launcher}
    path = run_dir.absolute() / "submit" / "preset.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def allocation_shape(launch, nodes: int, resident: set[str] = frozenset()) -> tuple[int, int, int]:
    """(tasks per node, CPUs per task, GPUs per node) an allocation of `nodes` nodes needs so that
    every placed stage's srun step fits: the steps of stages launched per call run one after
    another (the largest must fit); the resident steps of the stages in `resident` (those the
    iterations call, with `launch.resident`) run side by side for the whole run (their sum must
    fit, beside any one per-call step, which runs before them)."""
    from math import ceil

    per_call, side_by_side, cpus = (1, 0), (0, 0), 1
    for name, p in launch.stages.items():
        if p.nodes > nodes:
            raise ValueError(f"launch.{name}: nodes={p.nodes}, but the allocation has --nodes {nodes}")
        tasks = p.ranks_per_node if p.nodes * p.ranks_per_node > 1 else ceil(p.workers / nodes)
        gpus = max(p.gpus_per_node, p.gpus_per_worker * ceil(p.workers / nodes))
        cpus = max(cpus, p.cpus_per_task)
        per_call = (max(per_call[0], tasks), max(per_call[1], gpus))
        if launch.resident and name in resident:
            side_by_side = (side_by_side[0] + tasks, side_by_side[1] + gpus)
    return max(per_call[0], side_by_side[0]), cpus, max(per_call[1], side_by_side[1])


def render_run_slurm(preset, preset_file: Path, run_dir: Path, iterations: set[str], *, nodes: int = 1,
                     time: str = "01:00:00",
                     partition: str | None = None, account: str | None = None, python: str = sys.executable,
                     workdir: str | None = None, job_name: str | None = None) -> str:
    """The sbatch script of a whole run (`cluster/slurm/run.sbatch`): the driver runs
    `rlpipe run <preset_file> --local --run-dir <run_dir>` in the batch step. `iterations`: the
    stages each iteration calls (the plan's `iteration_stages()`), the ones a resident run keeps."""
    tasks, cpus, gpus = allocation_shape(preset.launch, nodes, resident=iterations)
    extra = [f"#SBATCH --gpus-per-node={gpus}"] if gpus else []
    extra += [f"#SBATCH --partition={partition}"] if partition else []
    extra += [f"#SBATCH --account={account}"] if account else []
    logs = run_dir.absolute() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return _template("slurm/run.sbatch").substitute(
        preset_name=preset.name, job_name=job_name or f"rlpipe-{preset.name}", nodes=nodes,
        tasks_per_node=tasks, cpus_per_task=cpus, time=time, log_dir=logs, sbatch_extra="\n".join(extra),
        workdir=shlex.quote(workdir or os.getcwd()), python=shlex.quote(python),
        preset_file=shlex.quote(str(preset_file)), run_dir=shlex.quote(str(run_dir.absolute())),
    )


def submit(kind: Literal["slurm", "k8s"], text: str, path: Path | None = None) -> str:
    """Write `text` to `path` (or a temporary file) and hand it to sbatch / kubectl; returns its
    stdout (the Slurm job id with --parsable)."""
    if path is None:
        fd, name = tempfile.mkstemp(prefix="rlpipe-", suffix=".sbatch" if kind == "slurm" else ".yaml")
        os.close(fd)
        path = Path(name)
    path.write_text(text)
    cmd = ["sbatch", "--parsable", str(path)] if kind == "slurm" else ["kubectl", "apply", "-f", str(path)]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlpipe.cluster.submit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=["slurm", "k8s"])
    p.add_argument("--stage", required=True, help="stage name (rollout, score, optimize, ...) or 'smoke'")
    p.add_argument("--config", help="the stage's YAML config (a path the nodes can read)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="stage config overrides")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=0, help="0: CPU ranks (gloo)")
    p.add_argument("--ranks-per-node", type=int, help="default: --gpus-per-node, or 1 on CPU")
    p.add_argument("--cpus-per-task", type=int, help="CPU cores per rank (OMP_NUM_THREADS)")
    p.add_argument("--job-name")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--workdir", default=os.getcwd(), help="working directory on the nodes")
    p.add_argument("--python", default=sys.executable, help="Slurm: the interpreter on the nodes")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="extra environment")
    p.add_argument("--launcher", choices=["srun", "torchrun"], default="srun", help="Slurm launcher")
    p.add_argument("--time", default="01:00:00", help="Slurm time limit")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--log-dir", default=".", help="Slurm: where %%x-%%j.out goes")
    p.add_argument("--image", default="rlpipe:latest", help="Kubernetes: container image")
    p.add_argument("--namespace", default="default")
    p.add_argument("--pvc", default="rlpipe-runs", help="Kubernetes: claim mounted at /runs")
    p.add_argument("--out", type=Path, help="write the rendered file here")
    p.add_argument("--submit", action="store_true", help="submit with sbatch / kubectl apply")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = _parser().parse_intermixed_args(argv)
    args = (["-c", str(Path(a.config).resolve())] if a.config else []) + list(a.overrides)
    env = dict(item.split("=", 1) for item in a.env)
    try:
        spec = JobSpec(
            stage=a.stage, args=tuple(args), nodes=a.nodes, gpus_per_node=a.gpus_per_node,
            ranks_per_node=a.ranks_per_node, job_name=a.job_name, cpus_per_task=a.cpus_per_task,
            master_port=a.master_port, workdir=a.workdir, python=a.python, env=env, launcher=a.launcher,
            time=a.time, partition=a.partition, account=a.account, log_dir=a.log_dir, image=a.image,
            namespace=a.namespace, pvc=a.pvc,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = render_slurm(spec) if a.kind == "slurm" else render_k8s(spec)
    if a.submit:
        print(submit(a.kind, text, a.out))
    elif a.out:
        a.out.write_text(text)
        print(a.out)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
