"""What a preset is: one YAML file names the data, the models, every stage's knobs and the number
of iterations. `Preset` validates it, and checks every stage fragment against that stage's own
config model at load time, so a typo in `rollout.temprature` is reported before anything runs.

The stage fragments hold the stage's knobs only; the pipeline fills in the fields each stage config
marks as `Input`, `Output` or `Assigned` (paths, run name, iteration, ...) for every call. Reading
a preset by name or path, with overrides, is `preset.py` (`load_preset`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlpipe.cluster.placement import Launch
from rlpipe.pipelines.keep import Keep
from rlpipe.stages.common.model_loading import ComputeDtype, ModelLoading


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class DataSpec(_Spec):
    """Where prompts come from: existing `prompts` artifacts, data files to import (JSONL, CSV,
    Parquet, a `datasets` directory; column names in the preset's `import_data` section), or a
    generated task."""

    task: dict[str, Any] | None = None
    """Knobs of the `task` stage (a synthetic verifiable task generated into runs/<run>/data/task/,
    the demo): kind, a_range, b_range, ops, n_train, n_heldout, sft_padded_fraction, ..."""
    prompts: Path | None = None
    """Training prompts: a `prompts` artifact or a data file to import (when no task is given)."""
    eval_prompts: Path | None = None
    """Held-out prompts for evaluation: an artifact or a data file (default: the training prompts)."""
    preferences: Path | None = None
    """Preference pairs for reward-model training (when the preset trains one): a `preferences`
    artifact or a data file to import."""

    @model_validator(mode="after")
    def _one_source(self) -> DataSpec:
        if (self.task is None) == (self.prompts is None):
            raise ValueError("set exactly one of data.task (generate prompts) or data.prompts (an artifact)")
        return self


class ModelSpec(_Spec):
    """The models a run starts from."""

    base: Path | None = None
    """Base policy: a checkpoint directory; a Hugging Face Hub id `org/name` or `org/name@revision`
    (resolved through the Hub cache once per run, its commit recorded in runs/<run>/hub.json:
    `pipelines/hub_models.py`); or a .gguf file, imported into the run first (the import_model
    stage; knobs in the preset's `import_model` section). None: the `base_model` stage builds a
    tiny model locally (knobs in the preset's `base_model` section)."""
    reward_model: Path | None = None
    """A trained reward model to score with, a directory or a Hub id as `base` (else the preset's
    reward_model stage trains one)."""
    reference: bool = False
    """Keep the starting policy (after SFT) as the frozen reference for KL."""
    critic: bool = False
    """Train a critic (PPO): initialised from the starting policy's backbone with a value head."""
    dtype: ComputeDtype = "auto"
    """What the run computes in: 'auto' (bf16 where CUDA is present, else fp32), 'fp32' or 'bf16'.
    Optimize trains in it (bf16: bf16 weights and activations, fp32 master weights and AdamW
    state), and the frozen roles load in it: the reference, the reward models, both rollout
    engines, evaluation. A stage's own `dtype` wins."""
    loading: ModelLoading = ModelLoading()
    """How every stage loads these models: `trust_remote_code` (run a checkpoint's own modelling
    code; off: such a checkpoint is refused naming this key) and `attn_implementation` (eager,
    sdpa, flash_attention_2, ...; None: transformers' default). A stage's own `loading` wins."""


class AsyncSpec(_Spec):
    """Asynchronous iterations: rollout runs ahead of optimisation by a fixed number of policies."""

    staleness: int = Field(0, ge=0)
    """S: rollout k samples from the policy optimize k-1-S wrote (the starting policy while there
    is none), so rollouts k+1..k+S (and their scores and advantages) can run while optimize k
    trains. Fixed by S, not by timing: the same seed and S give the same artifacts wherever the
    stages run. Optimize corrects for the stale behaviour policy with truncated importance
    sampling against the engine's log-probs (`optimize.tis_cap`, 2.0 unless set; docs/algorithms.md#async).
    0: synchronous (rollout k samples from optimize k-1's policy)."""


class Preset(_Spec):
    """A whole pipeline: data, models, the knobs of each stage, and how many iterations."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True,
                              validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

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
    base_model: dict[str, Any] = Field(default_factory=dict)
    """Knobs of the base_model stage (size, vocab_size, max_positions) when model.base is None."""
    sft: dict[str, Any] | None = None
    """SFT warm-start knobs (stage `sft`); None skips SFT."""
    reward_model: dict[str, Any] | None = None
    """Reward-model training knobs (stage `reward_model`); None: no reward model is trained."""
    preferences: dict[str, Any] = Field(default_factory=dict)
    """Knobs of the preferences stage, which builds the reward model's training pairs when
    data.preferences is not given: `kind: answers` pairs each training prompt's answer with a
    wrong one (`wrong`: near_miss or zero_padded). A preset that trains a reward model without
    data.preferences must set `kind` here: made-up pairs are never a silent default."""
    import_data: dict[str, Any] = Field(default_factory=dict)
    """Knobs of the import_data stage for the data.* entries that name data files: column names
    (prompt, messages, answer, id, chosen, rejected, margin) and split."""
    import_model: dict[str, Any] = Field(default_factory=dict)
    """Knobs of the import_model stage when model.base is a .gguf file (dtype)."""
    critic_init: dict[str, Any] = Field(default_factory=dict)
    """Knobs of the critic_init stage (head initialisation) when model.critic is true."""
    rollout: dict[str, Any] = Field(default_factory=dict)
    """Knobs of the rollout stage (group_size, temperature, max_new_tokens, ...)."""
    score: dict[str, Any] = Field(default_factory=dict)
    """Knobs of the score stage (components). A component `checkpoint: reward_model` uses the
    run's reward model."""
    reference: dict[str, Any] = Field(default_factory=dict)
    """Knobs of the reference forward-pass step (batch_size, device); runs when the preset uses a
    reference model or a critic."""
    filter: dict[str, Any] | None = None
    """Dynamic sampling (stage `filter`, between score and advantage): knobs `drop` (the group
    predicate, default all_equal) and `shortfall`; it keeps prompts_per_iteration groups of the
    rollout's ceil(prompts_per_iteration * rollout.oversample). None: no filter."""
    advantage: dict[str, Any] = Field(default_factory=dict)
    """Knobs of the advantage stage (estimator, std, scale, kl, gamma, lam)."""
    optimize: dict[str, Any] = Field(default_factory=dict)
    """Knobs of the optimize stage (loss, lr, epochs, kl_beta, zero_stage, ...)."""
    evaluate: dict[str, Any] = Field(default_factory=dict)
    """Knobs of the evaluate stage."""
    launch: Launch = Launch()
    """Where stages run: the launcher and per-stage processes, nodes and GPUs
    (`rlpipe.cluster.placement`); never changes the artifacts."""
    asynchronous: AsyncSpec = Field(AsyncSpec(), alias="async")
    """`async: {staleness: S}`: rollout S policies ahead of optimisation (see AsyncSpec)."""
    keep: Keep = Keep()
    """Which checkpoints and train states stay on disk (`rlpipe.pipelines.keep`): the last 2 train
    states, the policy of every 10th iteration, the last and the best evaluation; never changes
    the artifacts that stay."""
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

    @property
    def trains_reward_model(self) -> bool:
        """Whether the run trains its reward model (a `reward_model` section, no model.reward_model)."""
        return self.model.reward_model is None and self.reward_model is not None

    def fragment(self, stage: str) -> dict[str, Any] | None:
        """The preset's knobs for `stage` (None: the preset skips that optional stage)."""
        return self.data.task if stage == "task" else getattr(self, stage)

    @model_validator(mode="after")
    def _check_stage_fragments(self) -> Preset:
        from rlpipe.stages import STAGES

        for name, stage in STAGES.items():
            owned = set(self.fragment(name) or {}) & stage.config_class().pipeline_fields()
            if owned:
                raise ValueError(f"{name}: {sorted(owned)} are set by the pipeline, not the preset")
        if self.model.base is None and self.data.task is None:
            raise ValueError("model.base is required with data.prompts: the locally built tiny model "
                             "(model.base unset) only knows the characters of the built-in task")
        return self
