"""Pipeline presets: one YAML file names the data, the models, every stage's knobs and the number
of iterations. `Preset` validates it, and checks every stage fragment against that stage's own
config model at load time, so a typo in `rollout.temprature` is reported before anything runs.

The stage fragments hold the stage's knobs only; the pipeline fills in the paths (inputs, outputs)
and the per-iteration fields (iteration, policy_version, prompt_offset) for every call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlpipe.schemas.config import ConfigError, load_yaml, parse_config

PRESETS_DIR = Path(__file__).parent / "presets"

# Fields each stage gets from the pipeline, never from the preset.
PIPELINE_FIELDS: dict[str, set[str]] = {
    "sft": {"base", "prompts", "output", "metrics_output", "run", "iteration"},
    "reward_model": {"preferences", "base", "output", "metrics_output", "run"},
    "rollout": {"checkpoint", "prompts", "output", "run", "iteration", "policy_version",
                "num_prompts", "prompt_offset", "worker_index", "worker_count"},
    "score": {"rollouts", "output", "worker_index", "worker_count"},
    "reference": {"rollouts", "output", "reference_model", "critic"},
    "advantage": {"scores", "output", "rollouts", "reference"},
    "optimize": {"policy", "rollouts", "advantages", "reference", "critic", "output",
                 "critic_output", "metrics_output", "run"},
    "evaluate": {"checkpoint", "prompts", "output", "run", "iteration"},
}


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class TaskSpec(_Spec):
    """A synthetic verifiable task generated locally (no download): small integer arithmetic."""

    kind: Literal["arithmetic"] = "arithmetic"
    """The task family (only 'arithmetic' for now: prompts like '23+45=', answers like '68')."""
    a_range: tuple[int, int] = (0, 99)
    """(lowest, highest) first operand, inclusive."""
    b_range: tuple[int, int] = (0, 99)
    """(lowest, highest) second operand, inclusive; (0, 9) makes '+' much easier."""
    ops: tuple[Literal["+", "-", "*"], ...] = ("+",)
    """Operations drawn from."""
    n_train: int = Field(2000, ge=1)
    """Training prompts (SFT and RL draw from these)."""
    n_heldout: int = Field(200, ge=1)
    """Held-out prompts for evaluation (disjoint from training)."""
    sft_padded_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Deliberately flawed warm-start data (the demo): in the SFT copy of the training prompts,
    this fraction of the answers of problems whose first operand is >= `sft_padded_from` (drawn
    with the seed) is zero-padded to three digits ('068'), as if those problems came from a second
    source with another answer convention. The verifier accepts only the canonical answer ('68'),
    so the warm start answers many such problems in the wrong form, while sampling still tries
    the canonical one now and then: RL has to learn it from the reward alone. 0: canonical SFT."""
    sft_padded_from: int = Field(0, ge=0)
    """First operand from which SFT answers may be padded (see sft_padded_fraction)."""

    def to_task(self):
        from rlpipe.pipelines.tasks import ArithmeticTask

        return ArithmeticTask(a_range=self.a_range, b_range=self.b_range, ops=self.ops)


class DataSpec(_Spec):
    """Where prompts come from: existing `prompts` artifacts, or a generated task."""

    task: TaskSpec | None = None
    """Generate a synthetic task into runs/<run>/data/ (the demo)."""
    prompts: Path | None = None
    """Training `prompts` artifact (when no task is given)."""
    eval_prompts: Path | None = None
    """Held-out `prompts` artifact for evaluation (when no task is given)."""
    preferences: Path | None = None
    """`preferences` artifact for reward-model training (when the preset trains one)."""

    @model_validator(mode="after")
    def _one_source(self) -> DataSpec:
        if (self.task is None) == (self.prompts is None):
            raise ValueError("set exactly one of data.task (generate prompts) or data.prompts (an artifact)")
        return self


class ModelSpec(_Spec):
    """The models a run starts from."""

    base: Path | None = None
    """Base policy checkpoint (Hugging Face directory); None builds a tiny model locally."""
    tiny_size: Literal["micro", "tiny", "demo"] = "demo"
    """Size of the locally built model when `base` is None (demo: ~0.7M parameters)."""
    reward_model: Path | None = None
    """A trained reward model to score with (else the preset's reward_model stage trains one)."""
    reference: bool = False
    """Keep the starting policy (after SFT) as the frozen reference for KL."""
    critic: bool = False
    """Train a critic (PPO): initialised from the starting policy's backbone with a value head."""


class Preset(_Spec):
    """A whole pipeline: data, models, the knobs of each stage, and how many iterations."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """Preset name; also the default run name (runs/<name>/)."""
    description: str = ""
    """What the preset does, in a sentence or two."""
    seed: int = Field(0, ge=0)
    """Seed of every stage (sampling, shuffling, initialisation)."""
    iterations: int = Field(1, ge=1)
    """RL iterations: rollout -> score -> (reference) -> advantage -> optimize."""
    prompts_per_iteration: int = Field(16, ge=1)
    """Prompts (groups) per iteration; iteration k takes the next slice of the training prompts."""
    eval_every: int = Field(5, ge=0)
    """Evaluate on held-out prompts every k iterations (and before the first, and after the last);
    0 = only before the first and after the last."""
    data: DataSpec
    model: ModelSpec = ModelSpec()
    sft: dict[str, Any] | None = None
    """SFT warm-start knobs (stage `sft`); None skips SFT."""
    reward_model: dict[str, Any] | None = None
    """Reward-model training knobs (stage `reward_model`); None: no reward model is trained."""
    rollout: dict[str, Any] = Field(default_factory=dict)
    """Knobs of the rollout stage (group_size, temperature, max_new_tokens, ...)."""
    score: dict[str, Any] = Field(default_factory=dict)
    """Knobs of the score stage (components). A component `checkpoint: reward_model` uses the
    run's reward model."""
    reference: dict[str, Any] = Field(default_factory=dict)
    """Knobs of the reference forward-pass step (batch_size, device); runs when the preset uses a
    reference model or a critic."""
    advantage: dict[str, Any] = Field(default_factory=dict)
    """Knobs of the advantage stage (estimator, std, scale, kl, gamma, lam)."""
    optimize: dict[str, Any] = Field(default_factory=dict)
    """Knobs of the optimize stage (loss, lr, epochs, kl_beta, zero_stage, ...)."""
    evaluate: dict[str, Any] = Field(default_factory=dict)
    """Knobs of the evaluate stage."""
    loggers: list[str] = []
    """Metric sinks that get every iteration's summary, the resolved preset and sample
    completions, by name: tensorboard, mlflow, wandb (offline unless WANDB_MODE says otherwise);
    they write under runs/<run>/logs/<name>/ (see pipelines/sinks.py)."""

    @field_validator("loggers")
    @classmethod
    def _known_loggers(cls, names: list[str]) -> list[str]:
        from rlpipe.pipelines.sinks import check_sink_names

        check_sink_names(names)
        return names

    @model_validator(mode="after")
    def _check_stage_fragments(self) -> Preset:
        for stage, fields in PIPELINE_FIELDS.items():
            fragment = getattr(self, stage, None)
            if fragment is None:
                continue
            clash = sorted(set(fragment) & fields)
            if clash:
                raise ValueError(f"{stage}: {clash} are set by the pipeline, not the preset")
        return self


def load_preset(name_or_path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Preset:
    """A preset by built-in name (`demo`, `grpo`, ...) or YAML path, with `key=value` overrides;
    every stage fragment is validated against its stage config (see `pipelines.runner`)."""
    from rlpipe.schemas.config import apply_overrides

    path = Path(name_or_path)
    if not path.suffix:
        builtin = PRESETS_DIR / f"{name_or_path}.yaml"
        if not builtin.is_file():
            raise ConfigError(f"no preset named {str(name_or_path)!r}; built-in: {builtin_presets()}")
        path = builtin
    data = apply_overrides(load_yaml(path), list(overrides))
    preset = parse_config(Preset, data, str(path))
    from rlpipe.pipelines.runner import check_stage_configs

    check_stage_configs(preset, source=str(path))
    return preset


def builtin_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
