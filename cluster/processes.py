"""The `processes` launcher: placed stages as processes on this machine. A 'shards' stage is N
worker processes (`python -m rlpipe.stages.<name> -c <configs/<name>.yaml> worker_index=i
worker_count=N`), a 'ranks' stage one torchrun job, a 'single' stage one process; a resident
group the same processes running `rlpipe.cluster.worker`. They rendezvous on 127.0.0.1 at a free
port, gloo on the loopback interface, and each sees its own GPUs only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from rlpipe.cluster.gpus import cuda_visible_devices
from rlpipe.cluster.launch import LOOPBACK, free_port, stage_command, torchrun_executable
from rlpipe.cluster.logs import stage_log
from rlpipe.cluster.placed import PlacedLauncher, process_env, stage_argv, worker_argv
from rlpipe.cluster.placement import StagePlacement
from rlpipe.cluster.process_group import Process, ProcessGroup, run_processes
from rlpipe.cluster.workorders import GroupDir
from rlpipe.stages import StageCall, get_stage


class ProcessLauncher(PlacedLauncher):
    """Placed stages as processes on this machine (`local_processes`, `group_processes`)."""

    def start(self, call: StageCall, p: StagePlacement, force: bool, logs: Path) -> Path:
        return run_here(call, p, force, logs)

    def start_group(self, stage: str, p: StagePlacement, group: GroupDir, members: int, logs: Path) -> ProcessGroup:
        return ProcessGroup(group_processes(stage, p, group, logs))


def run_here(call: StageCall, p: StagePlacement, force: bool, logs: Path) -> Path:
    """Run one call of a placed stage as processes on this machine, to their end (StageLaunchError
    on a failure); returns its (first) log."""
    procs = local_processes(call, p, force, logs)
    run_processes(call.name, procs)
    return procs[0].log


def local_processes(call: StageCall, p: StagePlacement, force: bool, logs: Path) -> list[Process]:
    """The processes of one call of a placed stage on this machine (see the module doc)."""
    return placed_processes(call.name, p, stage_argv(call, force), logs,
                            lambda i, n: [f"worker_index={i}", f"worker_count={n}"])


def group_processes(stage: str, p: StagePlacement, group: GroupDir, logs: Path) -> list[Process]:
    """The processes of a placed stage's resident group on this machine."""
    return placed_processes(stage, p, worker_argv(group), logs, lambda i, n: ["--member", str(i), "--members", str(n)])


def placed_processes(stage: str, p: StagePlacement, argv: list[str], logs: Path,
                     split: Callable[[int, int], list[str]]) -> list[Process]:
    """`python <argv>` placed as `p` says: one torchrun job for a 'ranks' stage, N worker
    processes of a 'shards' stage (worker i gets the arguments `split(i, N)`), else one."""
    scaling = get_stage(stage).scaling
    env = process_env(p, loopback=True)
    if scaling == "ranks":
        scratch = logs / f".{stage}.torchrun"
        cmd = stage_command(stage, argv[2:], nproc_per_node=p.ranks_per_node, master_addr=LOOPBACK,
                            master_port=free_port(), module=argv[1], log_dir=str(scratch))
        return [Process([torchrun_executable(), *cmd[1:]], _gpus(env, p.worker_gpus(0)),
                        stage_log(logs, stage, 0, 1), scratch)]
    workers = p.workers if scaling == "shards" else 1
    return [Process([sys.executable, *argv, *(split(i, workers) if workers > 1 else [])],
                    _gpus(env, p.worker_gpus(i)), stage_log(logs, stage, i, workers))
            for i in range(workers)]


def _gpus(env: dict[str, str], ids: Sequence[int]) -> dict[str, str]:
    """A process of a GPU placement sees its own GPUs only (`ids`: of the driver's)."""
    return {**env, "CUDA_VISIBLE_DEVICES": cuda_visible_devices(ids, env.get("CUDA_VISIBLE_DEVICES"))} if ids else env
