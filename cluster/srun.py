"""Slurm: placed stages as `srun` steps of the allocation the driver runs in (`rlpipe submit
slurm`), from the launcher's side (`rlpipe.cluster.launchers`).

Per call (`resident: false`, set-up stages): one step per stage call, its tasks running the
stage. Resident (the default for the RL iterations): one long-lived step per placed stage for the
whole run, its tasks running `rlpipe.cluster.worker` (one member per task, output in
runs/<run>/logs/workers/<stage>.<task>.log); the steps of the placed stages run side by side, so
the allocation holds all of them at once (`rlpipe.cluster.submit.allocation_shape`). Either way a
task learns its rank (or worker index) from Slurm's variables, and a multi-rank step meets at its
first node (one node: on loopback).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from rlpipe.cluster.failures import StageLaunchError
from rlpipe.cluster.launch import LOOPBACK, free_port
from rlpipe.cluster.placed import PlacedLauncher, process_env, stage_argv, worker_argv
from rlpipe.cluster.placement import StagePlacement
from rlpipe.cluster.process_group import Process, ProcessGroup
from rlpipe.cluster.resident import Handle
from rlpipe.cluster.workorders import GroupDir
from rlpipe.stages import StageCall, get_stage

#: Run by every task of a step (bash -c SCRIPT stage ARGV...): the rank variables from Slurm's,
#: the rendezvous at the step's first node.
_RANK = ('export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID '
         'LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE '
         'MASTER_ADDR=$(scontrol show hostnames "$SLURM_STEP_NODELIST" | head -n 1); exec "$@"')
#: ... and a 'shards' task's worker index: the stage's own arguments (per call), a member's (resident).
_SRUN_TASK = {"ranks": _RANK, "shards": 'exec "$@" worker_index=$SLURM_PROCID worker_count=$SLURM_NTASKS',
              "single": 'exec "$@"'}
_SRUN_MEMBER = {**_SRUN_TASK, "shards": 'exec "$@" --member $SLURM_PROCID --members $SLURM_NTASKS'}


def srun_command(call: StageCall, p: StagePlacement, force: bool, log: Path, *,
                 allocation_nodes: int, python: str = sys.executable) -> list[str]:
    """The `srun` step of one call of a placed stage inside an allocation of `allocation_nodes` nodes."""
    return srun_step(call.name, p, [python, *stage_argv(call, force)], log, _SRUN_TASK,
                     allocation_nodes=allocation_nodes)


def srun_step(stage: str, p: StagePlacement, argv: list[str], output: Path, scripts: dict[str, str], *,
              allocation_nodes: int) -> list[str]:
    """`srun` of `argv` with the stage's placement: a task per rank of a 'ranks' stage, per
    worker of a 'shards' stage, else one; the tasks' output to `output` (appended)."""
    scaling = get_stage(stage).scaling
    if scaling == "ranks":
        shape = [f"--nodes={p.nodes}", f"--ntasks={p.nodes * p.ranks_per_node}",
                 f"--ntasks-per-node={p.ranks_per_node}"]
        gpus = [f"--gpus-per-node={p.gpus_per_node}"] if p.gpus_per_node else []
    else:
        tasks = p.workers if scaling == "shards" else 1
        shape = [f"--nodes={min(tasks, allocation_nodes)}", f"--ntasks={tasks}"]
        gpus = [f"--gpus-per-task={p.gpus_per_worker}"] if p.gpus_per_worker else []
    if p.nodes > allocation_nodes:
        raise ValueError(f"launch.{stage}: nodes={p.nodes}, but the allocation has {allocation_nodes}")
    return ["srun", f"--job-name=rlpipe-{stage}", *shape, f"--cpus-per-task={p.cpus_per_task}", *gpus,
            "--kill-on-bad-exit=1", f"--output={output}", "--open-mode=append", "bash", "-c", scripts[scaling],
            stage, *argv]


class SlurmLauncher(PlacedLauncher):
    """Placed stages as srun steps of the allocation the driver runs in (`rlpipe submit slurm`)."""

    def _allocation(self, stage: str, log: Path, p: StagePlacement) -> tuple[int, dict[str, str]]:
        """(nodes of the allocation, the steps' environment)."""
        if "SLURM_JOB_ID" not in os.environ:
            raise StageLaunchError(stage, None, log,
                                   "the slurm launcher runs inside a Slurm allocation: submit the run "
                                   "with `rlpipe submit slurm PRESET`, or run it under salloc")
        nodes = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
        # One node: rendezvous and gloo on loopback; several: at the step's first node.
        env = process_env(p, loopback=nodes == 1)
        env["MASTER_PORT"] = str(free_port("0.0.0.0" if nodes > 1 else LOOPBACK))
        return nodes, env

    def start(self, call: StageCall, p: StagePlacement, force: bool, logs: Path) -> Path:
        log = logs / f"{call.name}.log"
        nodes, env = self._allocation(call.name, log, p)
        cmd = srun_command(call, p, force, log, allocation_nodes=nodes)
        with open(log, "wb") as out:  # srun's own messages; the tasks append theirs (--open-mode)
            out.write(f"[rlpipe] {shlex.join(cmd)}\n".encode())
            out.flush()
            code = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        if code.returncode != 0:
            raise StageLaunchError(call.name, code.returncode, log)
        return log

    def start_group(self, stage: str, p: StagePlacement, group: GroupDir, members: int, logs: Path) -> Handle:
        """One srun step for the run: a member per task (`%t`: the task's number in its log's name)."""
        log = logs / f"{stage}.srun.log"
        nodes, env = self._allocation(stage, log, p)
        cmd = srun_step(stage, p, [sys.executable, *worker_argv(group)], logs / f"{stage}.%t.log", _SRUN_MEMBER,
                        allocation_nodes=nodes)
        return ProcessGroup([Process(cmd, env, log)])
