"""Stages on Prefect work pools: the `prefect` launcher's side (`rlpipe.cluster.launchers`).

A placed stage with `work_pool: gpu` becomes a run of the deployment `rlpipe-stage/gpu` (the
`rlpipe-stage` flow deployed on that pool by `python -m rlpipe.flows.deploy --stage-pool gpu`),
with the stage's saved config file and its placement as parameters. A worker of the pool picks
it up and runs the stage as the `processes` launcher would on its machine (N worker processes,
torchrun ranks), so a driver on a CPU pool can iterate while rollout and optimize run on GPU
nodes. The driver's task waits for the flow run; as with every launcher, the stage's manifest is
the completion signal, and the child flow run appears under the driver's task in the Prefect UI.
"""

from __future__ import annotations

from pathlib import Path

from rlpipe.cluster.launchers import StageLaunchError
from rlpipe.cluster.placement import StagePlacement
from rlpipe.pipelines.plan import StageCall
from rlpipe.schemas.config import ConfigError

#: The flow every stage deployment runs (`rlpipe.flows.run_flow.stage_flow`).
STAGE_FLOW = "rlpipe-stage"


def stage_deployment(pool: str) -> str:
    """The deployment of the stage flow on `pool`: `rlpipe-stage/<pool>`."""
    return f"{STAGE_FLOW}/{pool}"


def run_on_pool(call: StageCall, p: StagePlacement, force: bool, logs: Path) -> Path:
    """Run `call` as a flow run of its pool's stage deployment and wait for it; returns the log
    a worker-side launch writes (runs/<run>/logs/.../<stage>.log, on the shared filesystem)."""
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    name = stage_deployment(p.work_pool)
    placement = p.model_dump(mode="json", exclude_defaults=True, exclude={"work_pool"})
    try:
        flow_run = run_deployment(name, timeout=None, parameters={
            "name": call.name, "config_file": str(call.config_file.absolute()), "force": force,
            "placement": placement or None})
    except ObjectNotFound:
        raise ConfigError(f"launch.{call.name}.work_pool {p.work_pool!r}: the Prefect API has no deployment "
                          f"{name}; create it with `python -m rlpipe.flows.deploy --stage-pool {p.work_pool}` "
                          f"and start a worker: `prefect worker start --pool {p.work_pool}`") from None
    log = logs / f"{call.name}.log"
    state = flow_run.state
    if state is None or not state.is_completed():
        how = f"{state.name}: {state.message}" if state is not None else "no state"
        raise StageLaunchError(call.name, None, log,
                               f"flow run {flow_run.name} of {name} ended {how}; see its logs in Prefect")
    return log
