"""The stage registry: every stage of rlpipe, defined once.

A stage is a package `rlpipe.stages.<name>` with `config.py` (one typed config whose path fields
carry `Input` / `Output` markers), `run.py` (`run(config, *, force=False) -> Manifest`) and
`__main__.py` (`python -m rlpipe.stages.<name>`). The CLI (`rlpipe stage NAME`), the pipeline
runner, the Prefect flows and the cluster launchers all read `STAGES`; nothing else lists stages.
A `StageCall` (a stage with its config, saved under a folder) is what the pipeline plans and what
every launcher receives: it lives here, below both.

Light on purpose: importing this module imports neither torch nor the stages themselves.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from rlpipe.schemas.config import StageConfig

#: How a stage scales out: 'shards' (N independent worker processes, each writing a disjoint set
#: of shards: `worker_index` / `worker_count`), 'ranks' (one multi-rank job: torchrun, DeepSpeed),
#: or 'single' (one process).
Scaling = Literal["shards", "ranks", "single"]


@dataclass(frozen=True)
class Stage:
    """One registry entry."""

    name: str
    """The stage name: `rlpipe stage <name>`, `python -m rlpipe.stages.<name>`, configs/<name>.yaml."""
    config: str
    """Class name of its config in `rlpipe.stages.<name>.config`."""
    summary: str
    """One line for listings."""
    scaling: Scaling = "single"
    """How the stage runs on more than one process."""
    retries: int = 0
    """Retries of a failed call: by Prefect (any failure but a user error) and by the local runner
    (a placed stage whose worker was lost): only stages whose failures can be transient (engines, workers)."""
    weights: Literal["send", "receive"] | None = None
    """Its end of the weight channel between resident groups (stages/common/weight_channel.py):
    'send' (it trains the policy), 'receive' (it samples from the policy just trained)."""

    @property
    def module(self) -> str:
        """The package run by `python -m`."""
        return f"rlpipe.stages.{self.name}"

    def config_class(self) -> type[StageConfig]:
        return getattr(importlib.import_module(f"{self.module}.config"), self.config)

    def run(self, config: StageConfig, *, force: bool = False) -> Any:
        """Run the stage in this process; returns its primary output's manifest."""
        return importlib.import_module(f"{self.module}.run").run(config, force=force)


STAGES: dict[str, Stage] = {s.name: s for s in (
    # set-up
    Stage("task", "TaskConfig", "generate a synthetic verifiable task as prompts artifacts"),
    Stage("base_model", "BaseModelConfig", "build a tiny tokenizer and model locally (no download)"),
    Stage("import_data", "ImportDataConfig", "import prompts or preference pairs from JSONL, CSV, Parquet or datasets"),
    Stage("import_model", "ImportModelConfig", "import a pretrained model from a GGUF file as a checkpoint"),
    Stage("preferences", "PreferencesConfig", "build a synthetic preference set for reward-model training"),
    Stage("sft", "SFTConfig", "supervised warm start (DeepSpeed)", scaling="ranks"),
    Stage("reward_model", "RewardModelConfig", "Bradley-Terry reward-model training (DeepSpeed)", scaling="ranks"),
    Stage("critic_init", "CriticInitConfig", "a critic (value head) initialised from a policy"),
    # one RL iteration
    Stage("rollout", "RolloutConfig", "sample G responses per prompt with the policy", scaling="shards", retries=1,
          weights="receive"),
    Stage("score", "ScoreConfig", "reward components and the total reward", scaling="shards", retries=1),
    Stage("reference", "ReferenceConfig", "reference log-probs and critic values", scaling="shards", retries=1),
    Stage("filter", "FilterConfig", "dynamic sampling: drop groups by a predicate (all rewards equal), keep N"),
    Stage("advantage", "AdvantageConfig", "advantage estimators (grpo, rloo, gae, ...)"),
    Stage("optimize", "OptimizeConfig", "policy (and critic) optimisation (DeepSpeed)", scaling="ranks",
          weights="send"),
    Stage("evaluate", "EvaluateConfig", "held-out greedy accuracy", retries=1),
)}


def get_stage(name: str) -> Stage:
    """The registry entry of `name`; a clear error listing the stages otherwise."""
    try:
        return STAGES[name]
    except KeyError:
        raise KeyError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}") from None


def stage_config(name: str, fragment: dict[str, Any] | None, source: str = "preset", /,
                 **assigned: Any) -> StageConfig:
    """The config of stage `name`: its knobs (from a preset, say) plus the fields the caller assigns
    (positional-only arguments: a stage's own `name` or `source` field is an assigned one)."""
    from rlpipe.schemas.config_files import parse_config

    cls = get_stage(name).config_class()
    return parse_config(cls, {**(fragment or {}), **assigned}, f"{source} ({name})")


@dataclass(frozen=True)
class StageCall:
    """One stage to run: its registry name, its config, and the folder its YAML is saved in."""

    name: str
    config: StageConfig
    config_dir: Path

    @property
    def config_file(self) -> Path:
        """configs/<stage>.yaml: rerun the stage alone with `rlpipe stage <name> -c <this file>`."""
        return self.config_dir / f"{self.name}.yaml"
