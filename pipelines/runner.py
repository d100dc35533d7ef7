"""The pipeline as plain Python: data -> (SFT) -> (reward model) -> iterations of
rollout -> score -> (reference) -> advantage -> optimize, with evaluations on held-out prompts.

It owns the run directory (see `layout.py`); what runs, with which config, is the `Plan`
(`plan.py`). Stages are called through `call(stage_call) -> Manifest`: by the launcher the
preset's `launch` section names (`rlpipe.cluster.launchers`; in-process by default, where models
stay warm in memory between iterations and artifacts stay the only hand-off), or wrapped in
Prefect tasks by `rlpipe.flows`. Every stage skips itself when an
artifact with the same cache key exists, so rerunning a crashed run resumes it: finished stages
are not recomputed, unfinished ones are recomputed from scratch.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from rlpipe.pipelines.hub_models import resolve_ids, write_record
from rlpipe.pipelines.keep import prune_run
from rlpipe.pipelines.layout import RunLayout
from rlpipe.pipelines.lock import run_lock
from rlpipe.pipelines.plan import Plan
from rlpipe.pipelines.preset_spec import Preset
from rlpipe.pipelines.saved_preset import preset_differences
from rlpipe.pipelines.schedule import run_overlapped
from rlpipe.schemas import Manifest
from rlpipe.schemas.atomic import write_if_changed
from rlpipe.schemas.config import StageConfig
from rlpipe.schemas.config_files import ConfigError, map_paths
from rlpipe.schemas.runs import iteration_dirs
from rlpipe.stages import StageCall
from rlpipe.stages.common.background import allow_background, wait_for_background

_log = logging.getLogger(__name__)

StageCallable = Callable[[StageCall], Manifest]
#: libyaml's dumper where PyYAML has it (the same YAML, ~5x faster than the pure-Python one)
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


@dataclass
class IterationRecord:
    """What one iteration did: time per stage (s) and its headline metrics."""

    iteration: int
    seconds: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


def _fmt(seconds: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.2f}" for k, v in seconds.items())


class Pipeline:
    """Runs a preset into `runs/<run>/`, stage by stage, through `call`.

    Args:
        preset: the validated preset.
        run_dir: the run directory (default runs/<preset.name>).
        call: how a stage call is run (its saved config file is `call.config_file`); default: the
            launcher of `preset.launch` (`rlpipe.cluster.launchers.launcher_for`), `self.launcher`,
            which the run closes when it ends (stopping its resident worker groups).
        on_iteration: called with each IterationRecord (the flow publishes Prefect artifacts).
        log: where progress lines go (default: the `rlpipe.pipelines.runner` logger, at INFO).
    """

    def __init__(self, preset: Preset, run_dir: Path | str | None = None, *, call: StageCallable | None = None,
                 on_iteration: Callable[[IterationRecord], None] | None = None,
                 log: Callable[[str], None] | None = None):
        self.preset = preset
        self.layout = RunLayout(Path(run_dir) if run_dir is not None else Path("runs") / preset.name)
        # (models and data named by Hub id run from their snapshot folders; the preset saved keeps the ids)
        model, hub_models = resolve_ids("model", dict(preset.model), self.layout.hub_record)
        data, hub_data = resolve_ids("data", dict(preset.data), self.layout.hub_record)
        self.hub_ids = {**hub_models, **hub_data}
        planned = preset.model_copy(update={"model": preset.model.model_copy(update=model),
                                            "data": preset.data.model_copy(update=data)})
        self.plan = Plan(planned, self.layout, str(self.layout.preset_file))
        from rlpipe.cluster.launchers import launcher_for

        # (GPUs two resident groups would share are refused here, before anything starts)
        self.launcher = launcher_for(preset.launch, self.plan.iteration_stages(), self.overlaps)
        self.call = call or self.launcher
        self.on_iteration = on_iteration
        self.log = log or _log.info
        self.records: list[IterationRecord] = []

    def execute(self, call: StageCall, seconds: dict[str, float]) -> Manifest:
        """Save the call's config as YAML (so the stage can be rerun alone: `rlpipe stage <name> -c
        <that file>`) and run it through `call`, adding its time to `seconds`."""
        self._save_config(call)
        started = time.perf_counter()
        manifest = self._call_retrying(call)
        seconds[call.name] = seconds.get(call.name, 0.0) + time.perf_counter() - started
        return manifest

    @staticmethod
    def _save_config(call: StageCall) -> None:
        write_if_changed(call.config_file, yaml.dump(_relative_paths(call.config, call.config_dir), Dumper=_DUMPER,
                                                     sort_keys=False).encode())

    def _call_retrying(self, call: StageCall) -> Manifest:
        """`call(call)`; a placed stage whose worker was lost (a `MachineError`) is called again,
        as many times as the stage registry's `retries` (the Prefect flow's retries, which its
        tasks apply themselves: here only when the launcher is the call, as in `--local`)."""
        from rlpipe.schemas.errors import MachineError
        from rlpipe.stages import get_stage

        retries = get_stage(call.name).retries if self.call is self.launcher else 0
        for attempt in range(retries):
            try:
                return self.call(call)
            except MachineError as e:
                if getattr(e, "node", None) is not None:  # (a node lost: rerun once the scheduler has nodes)
                    raise
                self.log(f"retrying {call.name} ({attempt + 1}/{retries}), a worker was lost: {e}")
                self._recompute_unwritten_policy()  # (a new rollout group holds no policy yet)
        return self.call(call)

    def run(self) -> list[IterationRecord]:
        """Set-up stages, then the iterations; returns one record per iteration."""
        self.layout.root.mkdir(parents=True, exist_ok=True)
        with run_lock(self.layout.root, log=self.log) as writable:
            allow_background()  # (stages in this process: optimize's train state, while the run goes on)
            try:
                return self._run(writable)
            finally:  # the run ended, failed or was interrupted: no worker outlives it, no save is left half done
                wait_for_background(raise_errors=False)
                allow_background(False)
                self.launcher.close()

    def _run(self, writable: bool) -> list[IterationRecord]:
        from rlpipe.pipelines.sinks import RunMonitor

        p, L = self.preset, self.layout
        self.plan.check_inputs()
        self._start_run_dir()
        # Metric sinks + the report after every iteration (neither on a read-only run directory).
        self.monitor, self._writable = RunMonitor(p, L.root, enabled=writable), writable
        setup: dict[str, float] = {}
        for call in self.plan.setup():
            self.execute(call, setup)
        self.log(f"start: {self._eval_line(L.initial_eval())}  (setup {_fmt(setup)})")
        self._last_done = time.perf_counter()
        self._recompute_unwritten_policy()
        if self.overlaps:
            run_overlapped(p.iterations, self.plan.staleness, calls=self.plan.iteration, execute=self.execute,
                           finish=self.finish, interrupt=self.launcher.close)
        else:
            for k in range(p.iterations):
                seconds: dict[str, float] = {}
                for call in self.plan.iteration(k):
                    self.execute(call, seconds)
                self.finish(k, seconds)
        # What is still being written (train states, in this process or in resident workers) is
        # complete before the run ends; then the last prune counts it.
        wait_for_background()
        self.launcher.close(wait=True)
        if writable:
            prune_run(L.root, p.keep, staleness=self.plan.staleness, log=self.log)
        monitor = self.monitor
        monitor.close()  # closes the sinks, writes the final report
        self.log(f"final: {self._eval_line(self._last_eval())}   report: {L.report}/")
        return self.records

    def _recompute_unwritten_policy(self) -> None:
        """A resumed run (or a rollout retried on new workers) whose next rollout samples from a
        policy whose weights were never written (`optimize.policy_weights: with_train_state`) and
        that this process does not hold: that policy's optimize run is rerun first (the same bytes:
        its steps replayed from the last saved train state), so the rollout takes it from memory,
        or from its files where no rollout member is live to receive it."""
        from rlpipe.schemas.reading import exists, read_manifest
        from rlpipe.stages.common.models import holds

        L, last = self.layout, self.preset.iterations - 1
        k = next((k for k in reversed(range(last)) if exists(L.stage(k, "policy"))), None)
        if k is None or exists(L.stage(k + 1, "rollouts")):
            return
        manifest = read_manifest(L.stage(k, "policy"))
        if not manifest.not_written or holds(manifest.content_hash):
            return
        self.log(f"iteration {k + 1}'s policy ({L.stage(k, 'policy')}) was held in memory only (optimize.policy_weights: "
                 "with_train_state): rerunning its optimize run for the next rollout")
        call = next(c for c in self.plan.iteration(k) if c.name == "optimize")
        self._save_config(call)
        self.launcher(call, force=True)

    @property
    def overlaps(self) -> bool:
        """Whether the iterations overlap: rollout k+1..k+S (with their score and advantage) while
        optimize k trains (`async.staleness` S >= 1), which needs optimize on resident workers of
        its own (a placement, `launch.resident`: per-call launches are for GPUs that stages take by
        turns); otherwise the stages run in order. Either way S fixes what is computed, so both
        give the same artifacts."""
        launch = self.preset.launch
        return self.plan.staleness > 0 and launch.resident and launch.placement("optimize") is not None

    def finish(self, k: int, seconds: dict[str, float]) -> None:
        """Iteration k is complete: its record and line, the report and sinks, and the prune."""
        now = time.perf_counter()
        seconds["total"], self._last_done = now - self._last_done, now
        record = IterationRecord(k, seconds, self._iteration_metrics(k))
        self.records.append(record)
        self.log(self._line(record))
        self.monitor.on_iteration(record)
        if self.on_iteration is not None:
            self.on_iteration(record)
        if self._writable:  # what `keep` no longer keeps goes once the iteration is complete
            prune_run(self.layout.root, self.preset.keep, staleness=self.plan.staleness, log=self.log)

    def _start_run_dir(self) -> None:
        L = self.layout
        L.root.mkdir(parents=True, exist_ok=True)
        preset = self.preset.model_dump(mode="json")
        if L.preset_file.is_file():
            # The same preset with another number of iterations extends (or reruns a prefix of) the
            # run: every finished stage is a cache hit; where metrics go changes no result either.
            # Anything else is another run. Compared by meaning: a run an older rlpipe started
            # (without the keys added since) is the same run (`saved_preset`).
            changed = preset_differences(L.preset_file, self.preset)
            if changed:
                raise ConfigError(
                    f"{L.root} holds a run of a different preset ({L.preset_file} differs in {', '.join(changed)}); "
                    f"pass another run directory (--run-dir DIR) or delete {L.root} to start over"
                )
        write_if_changed(L.preset_file, yaml.safe_dump(preset, sort_keys=False).encode())
        write_record(L.hub_record, self.hub_ids)
        for key, hub in self.hub_ids.items():
            self.log(f"{key}: {hub.id} at {hub.revision} is commit {hub.commit} ({hub.path})")

    # -- what the user sees ----------------------------------------------------------------
    def _iteration_metrics(self, k: int) -> dict[str, float]:
        from rlpipe.pipelines.report import iteration_row

        # (the report's row of the iteration, which the report and sinks then read from its cache)
        row = iteration_row(self.layout.root, k)
        return {name: v for name, v in row.items() if name != "iteration" and not name.startswith("seconds_")}

    def _line(self, r: IterationRecord) -> str:
        m = r.metrics
        parts = [f"iter {r.iteration + 1:>3}/{self.preset.iterations}"]
        for key, label, fmt in (("reward_mean", "reward", ".3f"), ("accuracy", "acc", ".2f"),
                                ("eval_accuracy", "eval", ".2f"), ("kl_ref", "kl", ".4f"),
                                ("approx_kl", "kl_old", ".4f"), ("entropy", "ent", ".3f"),
                                ("response_length", "len", ".1f"), ("clip_fraction", "clip", ".3f")):
            if key in m:
                parts.append(f"{label} {m[key]:{fmt}}")
        parts.append(f"{r.seconds['total']:.2f}s ({_fmt({k: v for k, v in r.seconds.items() if k != 'total'})})")
        return " | ".join(parts)

    def _eval_line(self, path: Path | None) -> str:
        from rlpipe.pipelines.report import eval_metrics

        if path is None:
            return "no evaluation"
        m = eval_metrics(path)
        return "held-out " + ", ".join(f"{k} {v:.3f}" for k, v in m.items())

    def _last_eval(self) -> Path | None:
        evals = [d / "eval" for _, d in iteration_dirs(self.layout.root) if (d / "eval").exists()]
        return evals[-1] if evals else self.layout.initial_eval()


def _relative_paths(config: StageConfig, folder: Path) -> dict:
    """The config as YAML data with every path relative to `folder` (where the YAML goes): a
    saved config then reruns from any directory, and from a moved or copied run folder."""
    rel = map_paths(config, lambda _, p: Path(os.path.relpath(p.absolute(), folder.absolute())))
    return rel.resolved()


