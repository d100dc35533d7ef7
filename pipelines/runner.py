"""The pipeline as plain Python: data -> (SFT) -> (reward model) -> iterations of
rollout -> score -> (reference) -> advantage -> optimize, with evaluations on held-out prompts.

It owns the run directory (see `layout.py`) and builds every stage's config from the preset plus
the paths it assigns. Stages are called through `call(name, config) -> Manifest`: in-process by
default (the local runner: models stay warm in memory between iterations, artifacts stay the only
hand-off), or wrapped in Prefect tasks by `rlpipe.flows`. Every stage skips itself when an
artifact with the same cache key exists, so rerunning a crashed run resumes it: finished stages
are not recomputed, unfinished ones are recomputed from scratch.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlpipe.pipelines.layout import RunLayout
from rlpipe.pipelines.preset import PIPELINE_FIELDS, Preset
from rlpipe.schemas import Manifest
from rlpipe.schemas.config import ConfigError, StageConfig, parse_config
from rlpipe.stages.common.cli import import_ref

#: stage name -> (config class, run function), as import references (imported on first use).
STAGE_RUNS: dict[str, tuple[str, str]] = {
    "sft": ("rlpipe.stages.sft.config:SFTConfig", "rlpipe.stages.sft.run:run"),
    "reward_model": ("rlpipe.stages.reward_model.config:RewardModelConfig", "rlpipe.stages.reward_model.run:run"),
    "rollout": ("rlpipe.stages.rollout.config:RolloutConfig", "rlpipe.stages.rollout.run:run"),
    "score": ("rlpipe.stages.score.config:ScoreConfig", "rlpipe.stages.score.run:run"),
    "reference": ("rlpipe.stages.advantage.config:ReferenceConfig", "rlpipe.stages.advantage.reference:run_reference"),
    "advantage": ("rlpipe.stages.advantage.config:AdvantageConfig", "rlpipe.stages.advantage.run:run"),
    "optimize": ("rlpipe.stages.optimize.config:OptimizeConfig", "rlpipe.stages.optimize.run:run"),
    "evaluate": ("rlpipe.stages.evaluate.config:EvaluateConfig", "rlpipe.stages.evaluate.run:run"),
}

StageCall = Callable[[str, StageConfig], Manifest]


def run_stage(name: str, config: StageConfig, *, force: bool = False) -> Manifest:
    """Run one stage in this process."""
    return import_ref(STAGE_RUNS[name][1])(config, force=force)


def stage_config(name: str, fragment: dict[str, Any] | None, source: str = "preset", **pipeline: Any) -> StageConfig:
    """The stage's config: the preset's knobs for it plus the fields the pipeline assigns."""
    cls = import_ref(STAGE_RUNS[name][0])
    return parse_config(cls, {**(fragment or {}), **pipeline}, f"{source} ({name})")


def check_stage_configs(preset: Preset, source: str = "preset") -> None:
    """Build every stage config the preset uses, with placeholder paths: bad knobs fail now."""
    for name in _stages_used(preset):
        try:
            stage_config(name, getattr(preset, name), source, **_placeholders(name, preset))
        except ConfigError as e:
            raise ConfigError(re.sub(rf"{_PLACEHOLDER}[/\\w]*", "<set by the pipeline>", str(e))) from None


_PLACEHOLDER = Path("/placeholder")


def _placeholders(name: str, preset: Preset) -> dict[str, Any]:
    """The pipeline-owned fields a stage config requires, plus the optional inputs this preset
    will pass (a reference model or critic changes what the advantage stage accepts)."""
    fields = import_ref(STAGE_RUNS[name][0]).model_fields
    # Distinct paths per field: some configs check that an output differs from an input.
    out: dict[str, Any] = {f: _PLACEHOLDER / f for f in PIPELINE_FIELDS[name] if fields[f].is_required()}
    uses_reference = preset.model.reference or preset.model.critic
    if name == "advantage" and uses_reference:
        out.update(rollouts=_PLACEHOLDER, reference=_PLACEHOLDER)
    if name == "reference":
        out.update(reference_model=_PLACEHOLDER if preset.model.reference else None,
                   critic=_PLACEHOLDER if preset.model.critic else None)
    if name == "optimize" and preset.model.critic:
        out.update(critic=_PLACEHOLDER, critic_output=_PLACEHOLDER)
    return out


def _stages_used(preset: Preset) -> list[str]:
    used = ["rollout", "score", "advantage", "optimize", "evaluate"]
    if preset.sft is not None:
        used.append("sft")
    if preset.reward_model is not None:
        used.append("reward_model")
    if preset.model.reference or preset.model.critic:
        used.append("reference")
    return used


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
        call: how a stage is run: `run_stage` (in-process) or a Prefect task wrapper.
        on_iteration: called with each IterationRecord (the flow publishes Prefect artifacts).
        log: where progress lines go.
    """

    def __init__(self, preset: Preset, run_dir: Path | str | None = None, *, call: StageCall = run_stage,
                 on_iteration: Callable[[IterationRecord], None] | None = None,
                 log: Callable[[str], None] = print):
        self.preset = preset
        self.layout = RunLayout(Path(run_dir) if run_dir is not None else Path("runs") / preset.name)
        self.call = call
        self.on_iteration = on_iteration
        self.log = log
        self.records: list[IterationRecord] = []

    # -- one stage -------------------------------------------------------------------------
    def stage(self, name: str, config_dir: Path, **fields: Any) -> Manifest:
        """Build a stage's config, save it as YAML beside its output (so the stage can be rerun
        alone: `rlpipe stage <name> -c <that file>`), and run it through `call`."""
        fragment = dict(getattr(self.preset, name) or {})
        if "seed" in _fields_of(name):
            fragment.setdefault("seed", self.preset.seed)
        config = stage_config(name, fragment, str(self.layout.preset_file), **fields)
        config_dir.mkdir(parents=True, exist_ok=True)
        (config_dir / f"{name}.yaml").write_text(yaml.safe_dump(config.resolved(), sort_keys=False))
        started = time.perf_counter()
        manifest = self.call(name, config)
        self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - started
        return manifest

    # -- the whole run ---------------------------------------------------------------------
    def run(self) -> list[IterationRecord]:
        from rlpipe.pipelines.sinks import RunMonitor

        p, L = self.preset, self.layout
        self._start_run_dir()
        monitor = RunMonitor(p, L.root)  # metric sinks + the report, after every iteration
        self._seconds: dict[str, float] = {}
        train, heldout, sft_prompts = self._prepare_data()
        policy = self._prepare_base_model()
        setup = L.root / "configs"
        if p.sft is not None:
            self.stage("sft", setup, base=policy, prompts=sft_prompts, output=L.model("sft"),
                       metrics_output=L.model("sft_metrics"), run=L.name, iteration=0)
            policy = L.model("sft")
        reward_model = self._prepare_reward_model(policy, setup)
        reference = policy if p.model.reference else None
        critic = self._prepare_critic(policy) if p.model.critic else None
        self.stage("evaluate", setup, checkpoint=policy, prompts=heldout, output=L.initial_eval(),
                   run=L.name, iteration=0)
        self.log(f"start: {self._eval_line(L.initial_eval())}  (setup {_fmt(self._seconds)})")
        for k in range(p.iterations):
            self._seconds = {}
            started = time.perf_counter()
            policy, critic = self._iteration(k, policy, train, heldout, reference, critic, reward_model)
            record = self._record(k, time.perf_counter() - started)
            self.records.append(record)
            self.log(self._line(record))
            monitor.on_iteration(record)
            if self.on_iteration is not None:
                self.on_iteration(record)
        monitor.close()  # closes the sinks, writes the final report
        self.log(f"final: {self._eval_line(self._last_eval())}   report: {L.report}/")
        return self.records

    def _iteration(self, k: int, policy: Path, train: Path, heldout: Path, reference: Path | None,
                   critic: Path | None, reward_model: Path | None) -> tuple[Path, Path | None]:
        p, L = self.preset, self.layout
        cfgs = L.iteration(k) / "configs"
        # Iteration k samples the next slice of the training prompts (wrapping around).
        self.stage("rollout", cfgs, checkpoint=policy, prompts=train, output=L.stage(k, "rollouts"),
                   run=L.name, iteration=k, policy_version=k, num_prompts=p.prompts_per_iteration,
                   prompt_offset=k * p.prompts_per_iteration)
        self.stage("score", cfgs, rollouts=L.stage(k, "rollouts"), output=L.stage(k, "scores"),
                   **self._score_components(reward_model))
        extra: dict[str, Any] = {}
        if reference is not None or critic is not None:
            self.stage("reference", cfgs, rollouts=L.stage(k, "rollouts"), output=L.stage(k, "reference"),
                       reference_model=reference, critic=critic)
            extra = {"rollouts": L.stage(k, "rollouts"), "reference": L.stage(k, "reference")}
        self.stage("advantage", cfgs, scores=L.stage(k, "scores"), output=L.stage(k, "advantages"), **extra)
        self.stage("optimize", cfgs, policy=policy, rollouts=L.stage(k, "rollouts"),
                   advantages=L.stage(k, "advantages"), reference=extra.get("reference"),
                   critic=critic, output=L.stage(k, "policy"),
                   critic_output=L.stage(k, "critic") if critic is not None else None,
                   metrics_output=L.stage(k, "metrics"), run=L.name)
        policy = L.stage(k, "policy")
        critic = L.stage(k, "critic") if critic is not None else None
        last = k == p.iterations - 1
        if last or (p.eval_every and (k + 1) % p.eval_every == 0):
            self.stage("evaluate", cfgs, checkpoint=policy, prompts=heldout, output=L.stage(k, "eval"),
                       run=L.name, iteration=k + 1)
        return policy, critic

    # -- set-up steps ----------------------------------------------------------------------
    def _start_run_dir(self) -> None:
        L = self.layout
        L.root.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(self.preset.model_dump(mode="json"), sort_keys=False)
        if L.preset_file.is_file() and L.preset_file.read_text() != text:
            raise ConfigError(
                f"{L.root} holds a run of a different preset ({L.preset_file} differs); "
                f"pass another run name (--run NAME) or delete {L.root} to start over"
            )
        L.preset_file.write_text(text)

    def _prepare_data(self) -> tuple[Path, Path, Path]:
        """(training prompts, held-out prompts, SFT prompts) artifacts."""
        from rlpipe.pipelines import tasks
        from rlpipe.schemas import exists

        d = self.preset.data
        if d.task is None:
            assert d.prompts is not None
            return d.prompts, d.eval_prompts or d.prompts, d.prompts
        out = self.layout.data("task")
        task = d.task.to_task()
        if not (exists(out / "train") and exists(out / "heldout")):
            tasks.write_task(out, task, n_train=d.task.n_train, n_heldout=d.task.n_heldout, seed=self.preset.seed)
        if not d.task.sft_padded_fraction:
            return out / "train", out / "heldout", out / "train"
        if not exists(out / "sft"):
            tasks.write_mixed_format_copy(out / "train", out / "sft", fraction=d.task.sft_padded_fraction,
                                          pad_from=d.task.sft_padded_from, seed=self.preset.seed)
        return out / "train", out / "heldout", out / "sft"

    def _prepare_base_model(self) -> Path:
        m = self.preset.model
        if m.base is not None:
            return m.base
        from rlpipe.pipelines import tasks
        from rlpipe.stages.sft.base import make_base_checkpoint

        task = self.preset.data.task
        texts = tasks.tokenizer_texts(task.to_task()) if task else []
        out = self.layout.model("base")
        make_base_checkpoint(out, texts, size=m.tiny_size, seed=self.preset.seed)
        return out

    def _prepare_reward_model(self, policy: Path, setup: Path) -> Path | None:
        p, L = self.preset, self.layout
        if p.model.reward_model is not None:
            return p.model.reward_model
        if p.reward_model is None:
            return None
        preferences = p.data.preferences
        if preferences is None:
            from rlpipe.pipelines.models import synthetic_preferences_for

            preferences = synthetic_preferences_for(L.data("preferences"), p)
        self.stage("reward_model", setup, preferences=preferences, base=policy, output=L.model("reward"),
                   metrics_output=L.model("reward_metrics"), run=L.name)
        return L.model("reward")

    def _prepare_critic(self, policy: Path) -> Path:
        from rlpipe.schemas import exists
        from rlpipe.stages.advantage.critic import build_critic

        out = self.layout.model("critic")
        if not exists(out):
            build_critic(policy, out, seed=self.preset.seed)
        return out

    def _score_components(self, reward_model: Path | None) -> dict[str, Any]:
        comps = []
        for c in self.preset.score.get("components", []):
            c = dict(c)
            if c.get("type") == "reward_model" and c.get("checkpoint") in (None, "reward_model"):
                if reward_model is None:
                    raise ConfigError("score component of type reward_model needs a reward model: "
                                      "set model.reward_model or the reward_model stage in the preset")
                c["checkpoint"] = reward_model
            comps.append(c)
        return {"components": comps} if comps else {}

    # -- what the user sees ----------------------------------------------------------------
    def _record(self, k: int, total: float) -> IterationRecord:
        from rlpipe.pipelines.report import iteration_metrics

        seconds = dict(self._seconds)
        seconds["total"] = total
        return IterationRecord(k, seconds, iteration_metrics(self.layout.root, k))

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
        evals = sorted(self.layout.root.glob("iter_*/eval"))
        return evals[-1] if evals else self.layout.initial_eval()


def _fields_of(name: str) -> set[str]:
    return set(import_ref(STAGE_RUNS[name][0]).model_fields)
