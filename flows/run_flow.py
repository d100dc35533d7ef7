"""Prefect flows: a whole run, and one stage on saved artifacts.

Thin wrappers: the pipeline (`rlpipe.pipelines.runner.Pipeline`) decides what runs; here every
stage call becomes a Prefect task (retried where a retry can help), tasks pass configs and
manifests (paths and hashes, never tensors). Stages run through the preset's launcher
(`rlpipe.cluster.launchers`): in this process by default, so models stay warm between
iterations; a launched stage that fails fails its task with the exit code and the tail of its log. What the Prefect UI shows of a run:

- the data flow: each stage task is recorded as depending on the tasks that wrote its inputs
  (within an iteration rollout -> score -> (reference) -> advantage -> optimize -> evaluate; the
  next iteration's rollout on the optimize that wrote its policy), found by matching the input
  paths of its config against the outputs of earlier tasks;
- a progress artifact `<run>-progress`, updated after every stage, naming the running iteration;
- a table artifact `<run>-iterations`: the per-iteration summary (`report.run_table`, the same
  numbers as the report and `rlpipe inspect`), a new version after every iteration.

By default the flow runs on Prefect's temporary local API; with `PREFECT_API_URL` set it runs
under that server (and its UI shows the tasks and the artifacts).
"""

from __future__ import annotations

from rlpipe.flows.settings import configure, show_rlpipe_records

configure()

import re  # noqa: E402
import threading  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.artifacts import (  # noqa: E402
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NONE  # noqa: E402
from prefect.states import State  # noqa: E402
from prefect.utilities.annotations import quote  # noqa: E402

from rlpipe.cluster.inprocess import run_in_process  # noqa: E402
from rlpipe.cluster.launchers import Launcher  # noqa: E402
from rlpipe.pipelines.display import NOTE  # noqa: E402
from rlpipe.pipelines.plan import Plan  # noqa: E402
from rlpipe.pipelines.preset_spec import Preset  # noqa: E402
from rlpipe.pipelines.report import run_table, shown_iteration  # noqa: E402
from rlpipe.pipelines.runner import Pipeline  # noqa: E402
from rlpipe.schemas import Manifest  # noqa: E402
from rlpipe.schemas.errors import UserError  # noqa: E402
from rlpipe.schemas.runs import iteration_index  # noqa: E402
from rlpipe.stages import StageCall, get_stage  # noqa: E402


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


def artifact_key(text: str) -> str:
    """A Prefect artifact key: lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]", "-", text.lower())


@dataclass(frozen=True)
class Upstream:
    """What a dependency resolves to for the task waiting on it: the upstream task's name."""

    task: str


class FlowStages:
    """The run flow's `call(stage_call)`: each stage a Prefect task, run through `launcher`, with
    the tasks that wrote its inputs passed as `wait_for` (the API records them as its upstream
    dependencies), and the progress artifact updated after each stage of an iteration."""

    def __init__(self, plan: Plan, run: str, launcher: Launcher = run_in_process):
        self.launcher = launcher
        self.iterations = plan.preset.iterations
        # The stages every iteration runs (an evaluation only every few: not counted).
        self.stages = [c.name for c in plan.iteration(0) if c.name != "evaluate"]
        self.written_by: dict[Path, State] = {}  # artifact path -> final state of the task that wrote it
        # Every task's result stays referenced for the run: Prefect links a result's parts to its
        # task by id(), and a freed part's id reused by a new object would fake a dependency.
        self.results: list[Manifest] = []
        self.progress = create_progress_artifact(0.0, key=artifact_key(f"{run}-progress"),
                                                 description=f"rlpipe {run}: set-up")
        # An asynchronous run calls optimize from a second thread (pipelines/schedule.py).
        self._lock = threading.Lock()

    def __call__(self, call: StageCall) -> Manifest:
        name, config = call.name, call.config
        outputs = list(config.outputs().values())
        inputs = set(_paths(config.model_dump())) - set(outputs)
        with self._lock:
            upstream = [self.written_by[p] for p in sorted(inputs) if p in self.written_by]
        # e.g. "score[iter_0003]", "sft[models]": where in the run the stage writes.
        task_name = f"{name}[{outputs[0].parent.name}]" if outputs else name
        # The call quoted: Prefect would otherwise link any object in it that an earlier task
        # returned (the stage name is the same interned string as the `stage` of every earlier
        # manifest of that stage: rollout -> rollout across iterations); the data flow is exactly
        # `upstream`. Retries come from the registry: only stages whose failures can be transient.
        state = stage_task.with_options(name=task_name, retries=get_stage(name).retries, retry_delay_seconds=2)(
            quote(call), quote(self.launcher), wait_for=upstream, return_state=True)
        manifest = state.result()  # raises the stage's error when it failed
        with self._lock:
            self._record(name, task_name, state, manifest, outputs)
        return manifest

    def _record(self, name: str, task_name: str, state: State, manifest: Manifest, outputs: list[Path]) -> None:
        """The finished task's outputs, for the tasks that read them; the progress artifact."""
        self.results.append(manifest)
        # wait_for gets the state without the manifest: Prefect walks into what wait_for holds and
        # takes any object another task returned for a dependency on that task, and manifests
        # share strings (pydantic caches them when parsing): every task would depend on every other.
        bare = state.model_copy(update={"data": Upstream(task_name)})
        for p in outputs:
            self.written_by[p] = bare
        k = iteration_index(outputs[0].parent.name) if outputs else None
        if k is not None and name in self.stages:
            done = (k + (self.stages.index(name) + 1) / len(self.stages)) / self.iterations
            update_progress_artifact(self.progress, progress=100.0 * done,
                                     description=f"iteration {shown_iteration(k)}/{self.iterations}: {name} done")


def _paths(value: object):
    """Every Path in a config dump, nested ones (a score component's checkpoint) included."""
    if isinstance(value, Path):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _paths(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _paths(v)


def publish_table(run: str, run_dir: Path) -> None:
    """The per-iteration summary of the run so far as a table artifact (a new version of its key)."""
    table = run_table(run_dir)
    create_table_artifact(table=table.to_dicts(), key=artifact_key(f"{run}-iterations"),
                          description=f"rlpipe {run}: {table.height} iteration(s). {NOTE}")


@flow(name="rlpipe-run", log_prints=True)
def run_flow(preset: Preset, run_dir: str | None = None) -> str:
    """Run a preset: data, optional SFT / reward model, then the RL iterations with evaluations."""
    show_rlpipe_records()
    pipeline = Pipeline(preset, run_dir, log=get_run_logger().info)
    pipeline.call = FlowStages(pipeline.plan, pipeline.layout.name, pipeline.launcher)
    pipeline.on_iteration = lambda record: publish_table(pipeline.layout.name, pipeline.layout.root)
    pipeline.run()
    return str(pipeline.layout.root)


@flow(name="rlpipe-stage", log_prints=True)
def stage_flow(name: str, config: dict | None = None, force: bool = False, config_file: str | None = None,
               placement: dict | None = None, worker_group: str | None = None) -> dict:
    """Run one stage on saved artifacts: `config` as the stage's YAML would give it, or
    `config_file`, a saved `configs/<stage>.yaml` (what the prefect launcher sends to a work
    pool); with a `placement` (workers, ranks_per_node, ...) as the processes launcher would.
    With `worker_group` (a resident group's folder): run the group's members until they leave
    (`rlpipe.flows.pools.serve_group`)."""
    show_rlpipe_records()
    from rlpipe.cluster.placement import Launch
    from rlpipe.cluster.processes import ProcessLauncher
    from rlpipe.schemas.config_files import load_config
    from rlpipe.stages import stage_config
    from rlpipe.stages.common.hub import resolve_hub_inputs

    if worker_group is not None:
        from rlpipe.flows.pools import serve_group

        return serve_group(name, worker_group, placement)
    if config_file is not None:
        call = StageCall(name, load_config(get_stage(name).config_class(), config_file), Path(config_file).parent)
    else:
        call = StageCall(name, stage_config(name, config, "flow parameter"), Path.cwd())
    call = StageCall(name, resolve_hub_inputs(call.config), call.config_dir)  # (Hub ids: their snapshots)
    launcher = ProcessLauncher(Launch(launcher="processes", stages={name: placement})) if placement else run_in_process
    manifest = stage_task.with_options(name=name, retries=get_stage(name).retries)(call, launcher, force=force)
    return {"stage": name, "content_hash": manifest.content_hash, "rows": manifest.rows}
