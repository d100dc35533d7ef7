"""Launchers: how the pipeline's one stage-call seam (`Pipeline.call(stage_call) -> Manifest`)
runs a stage, as the preset's `launch` section places it (`rlpipe.cluster.placement`).

- `local`: in the driver's process (models stay warm between iterations).
- `processes`: a placed 'shards' stage as N local worker processes
  (`python -m rlpipe.stages.<name> -c <configs/<name>.yaml> worker_index=i worker_count=N`),
  a placed 'ranks' stage under torchrun, a placed 'single' stage as one process.
- `slurm`: inside an allocation (the driver runs in its batch step), each placed stage is one
  `srun` step with its own nodes and tasks; rendezvous from the step's nodes.
- `kubernetes`: each placed stage is an Indexed Job (`rlpipe.cluster.kubernetes`), applied and
  watched with kubectl from the driver's pod.
- `prefect`: a placed stage with a `work_pool` is a run of the `rlpipe-stage/<pool>` deployment
  (`rlpipe.flows.pools`), which a worker of that pool picks up and runs as `processes` would;
  placed stages without one run as `processes` on the driver's machine.

With `launch.resident` (the default) a placed stage of the RL iterations is started once per run
as a worker group that takes each call as a work order (`rlpipe.cluster.resident`): the same
processes, nodes and GPUs, running `python -m rlpipe.cluster.worker` instead of the stage; set-up
stages and `resident: false` launch per call.

Every launched process runs the config file the pipeline saved, so what it computes, and its
cache key, is that of `rlpipe stage <name> -c <file>`: a stage whose manifest matches skips
itself when it starts (resume), and the artifacts equal the in-process run's. The manifest is the
completion signal: a launch succeeds when every process exited 0 and every output of the call
has its manifest. A failed launch raises `StageLaunchError` with the exit code and the tail of
the stage's log (runs/<run>/logs/<iteration>/<stage>.log); a process killed by a signal is a
`WorkerLost`, the machine's failure (`rlpipe.cluster.failures`).

Addresses are explicit: single-machine launches rendezvous on 127.0.0.1 at a free port, and
gloo is told to use the loopback interface (GLOO_SOCKET_IFNAME), so nothing listens on a
network address; Slurm and Kubernetes launches rendezvous at the first node of the job.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from rlpipe.cluster.failures import StageLaunchError
from rlpipe.cluster.launch import LOOPBACK, free_port, local_env, stage_command, torchrun_executable
from rlpipe.cluster.placement import Launch, StagePlacement
from rlpipe.schemas import Manifest
from rlpipe.schemas.runs import iteration_index
from rlpipe.stages import StageCall, get_stage

if TYPE_CHECKING:
    from rlpipe.cluster.resident import Handle
    from rlpipe.cluster.workorders import GroupDir

class Launcher(Protocol):
    def __call__(self, call: StageCall, *, force: bool = False) -> Manifest: ...

    def close(self, *, wait: bool = False) -> None:
        """Stop what the launcher keeps running for the run (resident worker groups); `wait`: the
        run ended, let them finish what they write first."""
        ...


class InProcessLauncher:
    """The local launcher: the stage runs in this process. Before a training stage ('ranks'
    scaling) a vLLM engine a rollout left in this process makes room: on GPUs it sleeps (weights
    and KV cache freed, so optimize gets the memory) and the next rollout wakes it and loads the new
    policy in place (`rlpipe.stages.rollout.vllm_engine.make_room`)."""

    def __call__(self, call: StageCall, *, force: bool = False) -> Manifest:
        if get_stage(call.name).scaling == "ranks":
            make_room_here()
        return get_stage(call.name).run(call.config, force=force)

    def close(self, *, wait: bool = False) -> None:
        pass


def make_room_here() -> str:
    """Free the GPU memory of the vLLM engine a rollout left in this process, for a training stage
    on the same GPUs (`rlpipe.stages.rollout.vllm_engine.make_room`: 'slept', 'released', 'kept');
    'none' when no rollout here imported vLLM (nothing is imported to find out). Called by the
    in-process launcher and by resident members on a make-room order (`launch.share_gpus`)."""
    engine = sys.modules.get("rlpipe.stages.rollout.vllm_engine")
    return "none" if engine is None else engine.make_room()


run_in_process = InProcessLauncher()


def launcher_for(launch: Launch, resident: Collection[str] = (), overlapped: bool = False) -> Launcher:
    """The launcher the preset's `launch.launcher` names; `resident`: the stages the iterations call
    (their placed groups stay for the run), `overlapped`: the iterations overlap (async); both
    decide the GPUs of the stages it starts on this machine (`rlpipe.cluster.gpus.assign_gpus`)."""
    if launch.launcher == "local":
        return run_in_process
    return {"processes": ProcessLauncher, "slurm": _slurm_launcher, "kubernetes": _kubernetes_launcher,
            "prefect": PrefectPoolLauncher}[launch.launcher](launch, resident, overlapped)


def _slurm_launcher(launch: Launch, resident: Collection[str], overlapped: bool) -> Launcher:
    from rlpipe.cluster.srun import SlurmLauncher

    return SlurmLauncher(launch, resident, overlapped)


def _kubernetes_launcher(launch: Launch, resident: Collection[str], overlapped: bool) -> Launcher:
    from rlpipe.cluster.kubernetes import KubernetesLauncher

    return KubernetesLauncher(launch, resident, overlapped)


# -- what every launcher shares ---------------------------------------------------------------
def log_dir(call: StageCall) -> Path:
    """runs/<run>/logs/<iter_NNNN or setup>/ for a call whose configs live in
    runs/<run>/[iter_NNNN/]configs/."""
    where = call.config_dir.absolute().parent
    if iteration_index(where.name) is not None:
        return where.parent / "logs" / where.name
    return where / "logs" / "setup"


def completed(call: StageCall, log: Path) -> Manifest:
    """The manifest of the call's first output, once every output it returns with has one (the
    completion signal; one pruned after it was written counts, by its record; one written in the
    background, optimize's train state, is waited for by the stage that reads it)."""
    from rlpipe.schemas import ArtifactError
    from rlpipe.schemas.pruning import recorded_manifest

    outputs = call.config.returned_outputs()
    for path in outputs.values():
        try:
            recorded_manifest(path)
        except ArtifactError:
            raise StageLaunchError(call.name, None, log, f"its processes exited 0 but {path} has no "
                                   "valid manifest") from None
    return recorded_manifest(next(iter(outputs.values())))


def stage_argv(call: StageCall, force: bool) -> list[str]:
    """`-m rlpipe.stages.<name> -c <saved config, absolute> [--force]`: what every launched process runs."""
    return ["-m", get_stage(call.name).module, "-c", str(call.config_file.absolute()),
            *(["--force"] if force else [])]


def process_env(p: StagePlacement, *, loopback: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    """A launched process's environment: CPU (DeepSpeed's CPU accelerator) unless it has GPUs,
    `cpus_per_task` threads, unbuffered output (the log is the failure report), and with
    `loopback` gloo bound to the loopback interface."""
    env = local_env(base, cpu=p.gpus == 0, threads_per_rank=p.cpus_per_task)
    env["PYTHONUNBUFFERED"] = "1"
    if loopback:
        env["GLOO_SOCKET_IFNAME"] = loopback_interface()
    return env


def loopback_interface() -> str:
    """The name of the loopback interface ('lo' on Linux, 'lo0' on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n in ("lo", "lo0")), names[0] if names else "lo")


class PlacedLauncher:
    """A launcher for placed stages; unplaced stages run in the driver's process. A placed stage
    of the RL iterations runs on its resident group (`launch.resident`), others per call."""

    def __init__(self, launch: Launch, resident: Collection[str] = (), overlapped: bool = False):
        from rlpipe.cluster.gpus import assign_gpus
        from rlpipe.cluster.resident import ResidentGroups

        self.launch = assign_gpus(launch, resident, overlapped=overlapped)  # (refused here: before anything starts)
        self.groups = ResidentGroups(self.launch, self.start_group)

    def __call__(self, call: StageCall, *, force: bool = False) -> Manifest:
        placement = self.launch.placement(call.name)
        if placement is None:
            return run_in_process(call, force=force)
        logs = log_dir(call)
        logs.mkdir(parents=True, exist_ok=True)
        if self.launch.resident and iteration_index(logs.name) is not None:
            self.groups.make_room(self.launch.make_room_for(call.name), logs)  # (GPUs shared with a trainer)
            return completed(call, self.groups.run(call, placement, force, logs))
        return completed(call, self.start(call, placement, force, logs))

    def close(self, *, wait: bool = False) -> None:
        self.groups.close(wait=wait)

    def start(self, call: StageCall, p: StagePlacement, force: bool, logs: Path) -> Path:
        """Run the placed stage to its end (raise StageLaunchError on failure); returns its log."""
        raise NotImplementedError

    def start_group(self, stage: str, p: StagePlacement, group: GroupDir, members: int, logs: Path) -> Handle:
        """Start the resident group of a placed stage (`rlpipe.cluster.resident.StartGroup`)."""
        raise NotImplementedError


# -- processes on this machine ----------------------------------------------------------------
@dataclass(frozen=True)
class Process:
    """One process of a launch: its argv, environment and log file."""

    argv: list[str]
    env: dict[str, str]
    log: Path
    scratch: Path | None = None
    """A folder the process writes for its launcher only (torchrun's --log-dir, which it would
    otherwise make in the temporary directory and leave there): emptied before the process
    starts, removed once it has ended."""


def local_processes(call: StageCall, p: StagePlacement, force: bool, logs: Path) -> list[Process]:
    """The processes of one call of a placed stage on this machine (see the module doc)."""
    return placed_processes(call.name, p, stage_argv(call, force), logs,
                            lambda i, n: [f"worker_index={i}", f"worker_count={n}"])


def group_processes(stage: str, p: StagePlacement, group: GroupDir, logs: Path) -> list[Process]:
    """The processes of a placed stage's resident group on this machine."""
    return placed_processes(stage, p, worker_argv(group), logs, lambda i, n: ["--member", str(i), "--members", str(n)])


def worker_argv(group: GroupDir) -> list[str]:
    """`-m rlpipe.cluster.worker --group <folder>`: what every member of a resident group runs."""
    return ["-m", WORKER_MODULE, "--group", str(group.path.absolute())]


WORKER_MODULE = "rlpipe.cluster.worker"


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
        return [Process([torchrun_executable(), *cmd[1:]], _gpus(env, p.worker_gpus(0)), logs / f"{stage}.log", scratch)]
    if scaling == "shards" and p.workers > 1:
        return [Process([sys.executable, *argv, *split(i, p.workers)],
                        _gpus(env, p.worker_gpus(i)), logs / f"{stage}.{i}.log")
                for i in range(p.workers)]
    return [Process([sys.executable, *argv], _gpus(env, p.worker_gpus(0)), logs / f"{stage}.log")]


def _gpus(env: dict[str, str], ids: Sequence[int]) -> dict[str, str]:
    """A process of a GPU placement sees its own GPUs only (`ids`: of the driver's)."""
    from rlpipe.cluster.gpus import cuda_visible_devices

    return {**env, "CUDA_VISIBLE_DEVICES": cuda_visible_devices(ids, env.get("CUDA_VISIBLE_DEVICES"))} if ids else env


def start_processes(procs: Sequence[Process], running: list[tuple[Process, subprocess.Popen]]) -> None:
    """Start every process (each in its own session, output to its log), appending to `running`."""
    for proc in procs:
        if proc.scratch is not None:
            shutil.rmtree(proc.scratch, ignore_errors=True)  # (a killed driver's)
        with open(proc.log, "wb") as out:  # the child keeps its own copy of the descriptor
            running.append((proc, subprocess.Popen(proc.argv, env=proc.env, stdout=out, stdin=subprocess.DEVNULL,
                                                   stderr=subprocess.STDOUT, start_new_session=True)))


def run_processes(stage: str, procs: Sequence[Process], poll: float = 0.05) -> None:
    """Start every process, wait for all; the first failure stops the others and raises."""
    running: list[tuple[Process, subprocess.Popen]] = []
    try:
        start_processes(procs, running)
        pending = list(running)
        while pending:
            for proc, popen in list(pending):
                code = popen.poll()
                if code is None:
                    continue
                pending.remove((proc, popen))
                if code != 0:
                    raise StageLaunchError(stage, code, proc.log)
            time.sleep(poll)
    finally:
        _stop([popen for _, popen in running])
        _remove_scratch(procs)


def _remove_scratch(procs: Sequence[Process]) -> None:
    for proc in procs:
        if proc.scratch is not None:
            shutil.rmtree(proc.scratch, ignore_errors=True)


def _stop(popens: Sequence[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGTERM every process group still running (a worker's torchrun ranks too), then SIGKILL."""
    import signal

    alive = [p for p in popens if p.poll() is None]
    for p in alive:
        os.killpg(p.pid, signal.SIGTERM)
    deadline = time.time() + grace
    for p in alive:
        try:
            p.wait(max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


class ProcessGroup:
    """A resident group's processes (`rlpipe.cluster.resident.Handle`): worker processes, one
    torchrun job, or an srun step; member i is process i when there is one per member."""

    def __init__(self, procs: Sequence[Process]):
        self.running: list[tuple[Process, subprocess.Popen]] = []
        try:
            start_processes(procs, self.running)
        except BaseException:
            self.stop(0.0)
            raise

    @property
    def logs(self) -> list[Path]:
        return [proc.log for proc, _ in self.running]

    def ended(self) -> tuple[int, int | None] | None:
        for i, (_, popen) in enumerate(self.running):
            code = popen.poll()
            if code is not None:
                return code, i if len(self.running) > 1 else None
        return None

    def stop(self, grace: float) -> None:
        _stop([popen for _, popen in self.running], grace)
        _remove_scratch([proc for proc, _ in self.running])


class ProcessLauncher(PlacedLauncher):
    """Placed stages as processes on this machine (`local_processes`, `group_processes`)."""

    def start(self, call: StageCall, p: StagePlacement, force: bool, logs: Path) -> Path:
        procs = local_processes(call, p, force, logs)
        run_processes(call.name, procs)
        return procs[0].log

    def start_group(self, stage: str, p: StagePlacement, group: GroupDir, members: int, logs: Path) -> Handle:
        return ProcessGroup(group_processes(stage, p, group, logs))


class PrefectPoolLauncher(PlacedLauncher):
    """Placed stages with a `work_pool` on that Prefect work pool's workers; the others as
    processes on this machine."""

    def start(self, call: StageCall, p: StagePlacement, force: bool, logs: Path) -> Path:
        if p.work_pool is None:
            return ProcessLauncher(self.launch).start(call, p, force, logs)
        from rlpipe.flows.pools import run_on_pool

        return run_on_pool(call, p, force, logs)

    def start_group(self, stage: str, p: StagePlacement, group: GroupDir, members: int, logs: Path) -> Handle:
        if p.work_pool is None:
            return ProcessLauncher.start_group(self, stage, p, group, members, logs)
        from rlpipe.flows.pools import PoolGroup

        return PoolGroup(stage, p, group, logs)
