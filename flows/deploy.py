"""Put the `rlpipe-run` flow on a Prefect work pool, so workers on a cluster pick runs up; and
the `rlpipe-stage` flow on the pools a preset's `launch` routes stages to (launcher prefect).

    PREFECT_API_URL=http://prefect:4200/api python -m rlpipe.flows.deploy --pool cpu-pool \
        --name grpo --preset grpo [key=value ...]
    python -m rlpipe.flows.deploy --stage-pool gpu-pool      # rlpipe-stage/gpu-pool
    prefect deployment run 'rlpipe-run/grpo' --watch

The deployment points at the installed package by module path (`rlpipe.flows.run_flow:run_flow`),
not at a file, so a worker imports the flow exactly as `rlpipe run` does (no second copy of the
modules through a script path on sys.path). The preset is validated here and stored, resolved,
as the deployment's default parameter.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rlpipe.flows.settings import configure

configure()

ENTRYPOINT = "rlpipe.flows.run_flow:run_flow"


def deploy_stage_flow(pool: str) -> str:
    """Create or update `rlpipe-stage/<pool>`, the deployment the prefect launcher runs the
    stages placed on `pool` with; returns its id."""
    from prefect.deployments.runner import EntrypointType

    from rlpipe.flows.run_flow import stage_flow

    return str(stage_flow.deploy(name=pool, work_pool_name=pool, entrypoint_type=EntrypointType.MODULE_PATH,
                                 build=False, push=False, print_next_steps=False))


def deploy(name: str, pool: str, preset_name: str, overrides: Sequence[str] = (),
           run_dir: str | None = None) -> str:
    """Create or update the deployment; returns its id.

    Args:
        run_dir: where runs of this deployment write; made absolute here, because a worker runs
            each flow in a working directory of its own (default: ./runs/<preset name>, which on a
            cluster should be a shared filesystem).
    """
    from prefect.deployments.runner import EntrypointType

    from rlpipe.flows.run_flow import run_flow
    from rlpipe.pipelines.preset import load_preset

    preset = load_preset(preset_name, list(overrides))
    where = str(Path(run_dir or Path("runs") / preset.name).resolve())
    return str(run_flow.deploy(name=name, work_pool_name=pool, entrypoint_type=EntrypointType.MODULE_PATH,
                               parameters={"preset": preset.model_dump(mode="json"), "run_dir": where},
                               build=False, push=False, print_next_steps=False))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlpipe.flows.deploy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool", help="Prefect work pool of the run deployment (with --name)")
    parser.add_argument("--name", help="name of the run deployment: rlpipe-run/<name>")
    parser.add_argument("--stage-pool", action="append", default=[], metavar="POOL",
                        help="deploy rlpipe-stage/<POOL> for the stages a preset routes to POOL (repeatable)")
    parser.add_argument("--preset", default="demo", help="built-in preset name or YAML path")
    parser.add_argument("--run-dir", default=None, help="run directory (made absolute; default ./runs/<preset>)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    if (args.pool is None) != (args.name is None) or (args.pool is None and not args.stage_pool):
        parser.error("give --pool and --name (a run deployment), --stage-pool POOL, or both")
    for pool in args.stage_pool:
        print(deploy_stage_flow(pool))
    if args.pool is not None:
        print(deploy(args.name, args.pool, args.preset, args.overrides, args.run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
