"""Stages on Prefect work pools: the `prefect` launcher (`PrefectPoolLauncher`, named in the
launcher registry `rlpipe.cluster.launchers`).

A placed stage with `work_pool: gpu` becomes a run of the deployment `rlpipe-stage/gpu` (the
`rlpipe-stage` flow deployed on that pool by `python -m rlpipe.flows.deploy --stage-pool gpu`),
with the stage's saved config file and its placement as parameters. A worker of the pool picks
it up and runs the stage as the `processes` launcher would on its machine (N worker processes,
torchrun ranks), so a driver on a CPU pool can iterate while rollout and optimize run on GPU
nodes. The driver's task waits for the flow run; as with every launcher, the stage's manifest is
the completion signal, and the child flow run appears under the driver's task in the Prefect UI.

Resident (`launch.resident`, the default for the stages of the RL iterations): one run of the
same deployment per placed stage for the whole run (`PoolGroup`), with the group's folder as a
parameter; the worker starts the group's processes as the `processes` launcher would and the flow
run lasts until they leave (the driver's stop order at the end of the run). The driver follows
its state: a flow run that fails or crashes fails the stage call in flight (crashed: its worker
was lost, the machine's failure); a stopped group's flow run is waited for until it has ended.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rlpipe.cluster.failures import StageLaunchError
from rlpipe.cluster.placed import PlacedLauncher
from rlpipe.cluster.placement import StagePlacement
from rlpipe.cluster.process_group import ProcessGroup
from rlpipe.cluster.processes import group_processes, run_here
from rlpipe.cluster.resident import Handle
from rlpipe.cluster.workorders import GroupDir
from rlpipe.schemas.config_files import ConfigError
from rlpipe.stages import StageCall

#: The flow every stage deployment runs (`rlpipe.flows.run_flow.stage_flow`).
STAGE_FLOW = "rlpipe-stage"


def stage_deployment(pool: str) -> str:
    """The deployment of the stage flow on `pool`: `rlpipe-stage/<pool>`."""
    return f"{STAGE_FLOW}/{pool}"


def _deployment_missing(stage: str, p: StagePlacement) -> ConfigError:
    return ConfigError(f"launch.{stage}.work_pool {p.work_pool!r}: the Prefect API has no deployment "
                       f"{stage_deployment(p.work_pool)}; create it with `python -m rlpipe.flows.deploy --stage-pool "
                       f"{p.work_pool}` and start a worker: `prefect worker start --pool {p.work_pool}`")


def _placement(p: StagePlacement) -> dict[str, Any] | None:
    return p.model_dump(mode="json", exclude_defaults=True, exclude={"work_pool"}) or None


class PrefectPoolLauncher(PlacedLauncher):
    """Placed stages with a `work_pool` on that Prefect work pool's workers; the others as
    processes on this machine (`rlpipe.cluster.processes`)."""

    def start(self, call: StageCall, p: StagePlacement, force: bool, logs: Path) -> Path:
        if p.work_pool is None:
            return run_here(call, p, force, logs)
        return run_on_pool(call, p, force, logs)

    def start_group(self, stage: str, p: StagePlacement, group: GroupDir, members: int, logs: Path) -> Handle:
        if p.work_pool is None:
            return ProcessGroup(group_processes(stage, p, group, logs))
        return PoolGroup(stage, p, group, logs)


def run_on_pool(call: StageCall, p: StagePlacement, force: bool, logs: Path) -> Path:
    """Run `call` as a flow run of its pool's stage deployment and wait for it; returns the log
    a worker-side launch writes (runs/<run>/logs/.../<stage>.log, on the shared filesystem)."""
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    name = stage_deployment(p.work_pool)
    try:
        flow_run = run_deployment(name, timeout=None, parameters={
            "name": call.name, "config_file": str(call.config_file.absolute()), "force": force,
            "placement": _placement(p)})
    except ObjectNotFound:
        raise _deployment_missing(call.name, p) from None
    log = logs / f"{call.name}.log"
    state = flow_run.state
    if state is None or not state.is_completed():
        how = f"{state.name}: {state.message}" if state is not None else "no state"
        raise StageLaunchError(call.name, None, log,
                               f"flow run {flow_run.name} of {name} ended {how}; see its logs in Prefect")
    return log


class PoolGroup:
    """A resident group as a flow run of the pool's stage deployment (`rlpipe.cluster.resident.Handle`)."""

    #: Seconds between looks at the flow run's state through the API.
    POLL_S = 2.0

    def __init__(self, stage: str, p: StagePlacement, group: GroupDir, logs: Path):
        from prefect.deployments import run_deployment
        from prefect.exceptions import ObjectNotFound

        try:  # timeout 0: started, not waited for
            self.flow_run = run_deployment(stage_deployment(p.work_pool), timeout=0, parameters={
                "name": stage, "worker_group": str(group.path.absolute()), "placement": _placement(p)})
        except ObjectNotFound:
            raise _deployment_missing(stage, p) from None
        self.stage, self.folder = stage, logs
        self._last, self._ended = 0.0, None

    @property
    def logs(self) -> list[Path]:
        """The members' own logs, on the shared filesystem (written once the pool's worker runs them)."""
        return sorted(self.folder.glob(f"{self.stage}.*.log"))

    def ended(self) -> tuple[int | None, int | None] | None:
        """(0, None) completed; (1, None) failed (a member's exit code other than 0: its answer
        says which); (None, None) crashed or cancelled: the pool's worker or its machine was lost."""
        if self._ended is None and time.monotonic() - self._last >= self.POLL_S:
            self._last = time.monotonic()
            state = self._read().state
            if state is not None and state.is_final():
                self._ended = (0 if state.is_completed() else 1 if state.is_failed() else None, None)
        return self._ended

    def stop(self, grace: float) -> None:
        """Cancel the flow run if it is still running (its members had the stop order first), and
        wait until it has ended (at most grace + 60 s): a new group of the stage never runs beside it."""
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelling

        state = self._read().state
        if state is not None and not state.is_final():
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(self.flow_run.id, Cancelling(), force=True)
        deadline = time.monotonic() + grace + 60
        while (state is not None and not state.is_final()) and time.monotonic() < deadline:
            time.sleep(self.POLL_S)
            state = self._read().state

    def _read(self) -> Any:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return client.read_flow_run(self.flow_run.id)


def serve_group(name: str, group: str, placement: dict | None) -> dict:
    """The worker's side of a `PoolGroup`: start the group's processes on this machine as the
    processes launcher would and wait for all of them to leave; a member that ends with another
    exit code than 0 fails the flow run (the driver then fails the call in flight)."""
    folder = GroupDir(Path(group))
    logs = folder.path.parent.parent / "logs" / "workers"
    logs.mkdir(parents=True, exist_ok=True)
    procs = ProcessGroup(group_processes(name, StagePlacement(**(placement or {})), folder, logs))
    try:
        codes = [popen.wait() for _, popen in procs.running]
    finally:  # (a cancelled flow run: its members are in sessions of their own)
        procs.stop(grace=10.0)
    if any(codes):
        raise RuntimeError(f"the {name} workers of {group} ended with exit codes {codes}; see {logs}")
    return {"stage": name, "worker_group": group, "exit_codes": codes}
