"""Prefect flows: a whole run, and one stage on saved artifacts.

Thin wrappers: the pipeline (`rlpipe.pipelines.runner.Pipeline`) decides what runs; here every
stage call becomes a Prefect task (retried where a retry can help), tasks pass configs and
manifests (paths and hashes, never tensors), and every iteration publishes a markdown table as a
Prefect artifact. Stages run through the preset's launcher (`rlpipe.cluster.launchers`): in this
process by default, so models stay warm between iterations; a launched stage that fails fails its
task with the exit code and the tail of its log.

By default the flow runs on Prefect's temporary local API; with `PREFECT_API_URL` set it runs
under that server (and its UI shows the tasks and the per-iteration tables).
"""

from __future__ import annotations

from rlpipe.flows.settings import configure

configure()

import re  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.artifacts import create_markdown_artifact  # noqa: E402
from prefect.cache_policies import NONE  # noqa: E402

from rlpipe.cluster.launchers import Launcher, launcher_for, run_in_process  # noqa: E402
from rlpipe.pipelines.plan import StageCall  # noqa: E402
from rlpipe.pipelines.preset import Preset  # noqa: E402
from rlpipe.pipelines.runner import IterationRecord, Pipeline  # noqa: E402
from rlpipe.schemas import Manifest  # noqa: E402
from rlpipe.schemas.errors import UserError  # noqa: E402
from rlpipe.schemas.runs import iteration_dir_name  # noqa: E402
from rlpipe.stages import get_stage  # noqa: E402


def _transient(task, task_run, state) -> bool:
    """Retry only what can be transient: a user error (bad config, data, reward function) fails
    the same way every time, so it ends the task at once."""
    try:
        state.result()
    except UserError:
        return False
    except BaseException:
        return True
    return True


@task(cache_policy=NONE, persist_result=False, retry_condition_fn=_transient)
def stage_task(call: StageCall, launcher: Launcher = run_in_process, force: bool = False) -> Manifest:
    """Run one stage call through `launcher` (default: in this process); skipped by the stage
    itself when its cache key matches."""
    return launcher(call, force=force)


def _call(call: StageCall, launcher: Launcher = run_in_process) -> Manifest:
    # e.g. "score[iter_0003]", "sft[models]": where in the run the stage writes. Retries come from
    # the registry: only stages whose failures can be transient (engines, workers) are retried.
    output = next(iter(call.config.outputs().values()), None)
    task_name = f"{call.name}[{Path(output).parent.name}]" if output is not None else call.name
    return stage_task.with_options(name=task_name, retries=get_stage(call.name).retries,
                                   retry_delay_seconds=2)(call, launcher)


def _publish(run: str, record: IterationRecord) -> None:
    rows = [f"| {k} | {v:.4g} |" for k, v in record.metrics.items()]
    rows += [f"| seconds_{k} | {v:.3f} |" for k, v in record.seconds.items()]
    create_markdown_artifact(
        # Artifact keys allow lowercase letters, digits and dashes only ("demo-iter-0003").
        key=re.sub(r"[^a-z0-9-]", "-", f"{run.lower()}-{iteration_dir_name(record.iteration)}"),
        markdown="\n".join([f"### {run}: iteration {record.iteration + 1}", "", "| metric | value |",
                            "|---|---|", *rows]),
        description=f"rlpipe {run} iteration {record.iteration + 1}",
    )


@flow(name="rlpipe-run", log_prints=True)
def run_flow(preset: Preset, run_dir: str | None = None) -> str:
    """Run a preset: data, optional SFT / reward model, then the RL iterations with evaluations."""
    pipeline = Pipeline(preset, run_dir, call=partial(_call, launcher=launcher_for(preset.launch)),
                        log=get_run_logger().info)
    pipeline.on_iteration = lambda record: _publish(pipeline.layout.name, record)
    pipeline.run()
    return str(pipeline.layout.root)


@flow(name="rlpipe-stage", log_prints=True)
def stage_flow(name: str, config: dict, force: bool = False) -> dict:
    """Run one stage on saved artifacts (config as the stage's YAML would give it)."""
    from rlpipe.pipelines.plan import stage_config

    call = StageCall(name, stage_config(name, config, "flow parameter"), Path.cwd())
    manifest = stage_task.with_options(name=name, retries=get_stage(name).retries)(call, force=force)
    return {"stage": name, "content_hash": manifest.content_hash, "rows": manifest.rows}
