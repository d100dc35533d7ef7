"""The base of the launchers that place stages on processes of their own (`PlacedLauncher`:
`processes`, `slurm`, `kubernetes`, `prefect`), and what they share: the command every launched
process runs (`stage_argv`, `worker_argv`), its environment (`process_env`) and the completion
signal (`completed`). See `rlpipe.cluster.launchers` for what each launcher does.
"""

from __future__ import annotations

import socket
from collections.abc import Collection
from pathlib import Path

from rlpipe.cluster.failures import StageLaunchError
from rlpipe.cluster.gpus import assign_gpus
from rlpipe.cluster.inprocess import run_in_process
from rlpipe.cluster.launch import local_env
from rlpipe.cluster.logs import log_dir
from rlpipe.cluster.placement import Launch, StagePlacement
from rlpipe.cluster.resident import Handle
from rlpipe.cluster.resident_groups import ResidentGroups
from rlpipe.cluster.workorders import GroupDir
from rlpipe.schemas import ArtifactError, Manifest
from rlpipe.schemas.reading import recorded_manifest
from rlpipe.schemas.runs import iteration_index
from rlpipe.schemas.writer import forget_finished_workers
from rlpipe.stages import StageCall, get_stage

#: The module every member of a resident group runs.
WORKER_MODULE = "rlpipe.cluster.worker"


class PlacedLauncher:
    """A launcher for placed stages; unplaced stages run in the driver's process. A placed stage
    of the RL iterations runs on its resident group (`launch.resident`), others per call."""

    def __init__(self, launch: Launch, resident: Collection[str] = (), overlapped: bool = False):
        self.launch = assign_gpus(launch, resident, overlapped=overlapped)  # (refused here: before anything starts)
        self.groups = ResidentGroups(self.launch, self.start_group)

    def __call__(self, call: StageCall, *, force: bool = False) -> Manifest:
        placement = self.launch.placement(call.name)
        if placement is None:
            return run_in_process(call, force=force)
        logs = log_dir(call)
        logs.mkdir(parents=True, exist_ok=True)
        if get_stage(call.name).scaling == "shards":  # every worker runs: only their markers count
            for path in call.config.outputs().values():
                forget_finished_workers(path)
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


def completed(call: StageCall, log: Path) -> Manifest:
    """The manifest of the call's first output, once every output complete on return has one (the
    completion signal; one pruned after it was written counts, by its record; one written in the
    background, optimize's train state, is waited for by the stage that reads it)."""
    outputs = call.config.outputs_complete_on_return()
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


def worker_argv(group: GroupDir) -> list[str]:
    """`-m rlpipe.cluster.worker --group <folder>`: what every member of a resident group runs."""
    return ["-m", WORKER_MODULE, "--group", str(group.path.absolute())]


def process_env(p: StagePlacement, *, loopback: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    """A launched process's environment: CPU (DeepSpeed's CPU accelerator) unless it has GPUs,
    `cpus_per_task` threads, unbuffered output (the log is the failure report), and with
    `loopback` gloo bound to the loopback interface. Without it (ranks on several nodes) a loopback
    binding this process holds for its own one-rank group (`init_distributed`) is not passed on:
    ranks bound to 127.0.0.1 on two nodes cannot reach each other (gloo then takes the address
    the node's host name resolves to, or the interface the user set)."""
    env = local_env(base, cpu=p.gpus == 0, threads_per_rank=p.cpus_per_task)
    env["PYTHONUNBUFFERED"] = "1"
    if loopback:
        env["GLOO_SOCKET_IFNAME"] = loopback_interface()
    elif env.get("GLOO_SOCKET_IFNAME") == loopback_interface():
        del env["GLOO_SOCKET_IFNAME"]
    return env


def loopback_interface() -> str:
    """The name of the loopback interface ('lo' on Linux, 'lo0' on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n in ("lo", "lo0")), names[0] if names else "lo")
