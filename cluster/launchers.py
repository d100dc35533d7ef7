"""Launchers: how the pipeline's one stage-call seam (`Pipeline.call(stage_call) -> Manifest`)
runs a stage, as the preset's `launch` section places it (`rlpipe.cluster.placement`).

- `local`: in the driver's process (models stay warm between iterations; `rlpipe.cluster.inprocess`).
- `processes`: a placed 'shards' stage as N local worker processes
  (`python -m rlpipe.stages.<name> -c <configs/<name>.yaml> worker_index=i worker_count=N`),
  a placed 'ranks' stage under torchrun, a placed 'single' stage as one process
  (`rlpipe.cluster.processes`).
- `slurm`: inside an allocation (the driver runs in its batch step), each placed stage is one
  `srun` step with its own nodes and tasks; rendezvous from the step's nodes (`rlpipe.cluster.srun`).
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
`WorkerLost`, the machine's failure (`rlpipe.cluster.failures`). What the placed launchers share
is their base, `rlpipe.cluster.placed.PlacedLauncher`.

Addresses are explicit: single-machine launches rendezvous on 127.0.0.1 at a free port, and
gloo is told to use the loopback interface (GLOO_SOCKET_IFNAME), so nothing listens on a
network address; Slurm and Kubernetes launches rendezvous at the first node of the job.

This module is the registry: `launcher_for` finds the launcher a preset names by its
'module:attribute' reference (`LAUNCHERS`), imported only when asked for: nothing here imports a
placed launcher, so the `prefect` one can live with the flows (`rlpipe.flows.pools`), above `cluster`.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from rlpipe.cluster.inprocess import run_in_process
from rlpipe.cluster.placement import Launch
from rlpipe.schemas import Manifest
from rlpipe.stages import StageCall
from rlpipe.stages.common.cli import import_ref


class Launcher(Protocol):
    def __call__(self, call: StageCall, *, force: bool = False) -> Manifest: ...

    def close(self, *, wait: bool = False) -> None:
        """Stop what the launcher keeps running for the run (resident worker groups); `wait`: the
        run ended, let them finish what they write first."""
        ...


#: The launchers that place stages, by `launch.launcher`: 'module:class' of a
#: `rlpipe.cluster.placed.PlacedLauncher`, imported at lookup (`launcher_for`).
LAUNCHERS: dict[str, str] = {
    "processes": "rlpipe.cluster.processes:ProcessLauncher",
    "slurm": "rlpipe.cluster.srun:SlurmLauncher",
    "kubernetes": "rlpipe.cluster.kubernetes:KubernetesLauncher",
    "prefect": "rlpipe.flows.pools:PrefectPoolLauncher",
}


def launcher_for(launch: Launch, resident: Collection[str] = (), overlapped: bool = False) -> Launcher:
    """The launcher the preset's `launch.launcher` names; `resident`: the stages the iterations call
    (their placed groups stay for the run), `overlapped`: the iterations overlap (async); both
    decide the GPUs of the stages it starts on this machine (`rlpipe.cluster.gpus.assign_gpus`)."""
    if launch.launcher == "local":
        return run_in_process
    return import_ref(LAUNCHERS[launch.launcher])(launch, resident, overlapped)
