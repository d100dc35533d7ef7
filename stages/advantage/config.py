"""Config of the advantage stage (no heavy imports)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlpipe.schemas.config import Input, Output, StageConfig

#: The names in `rlpipe.stages.advantage.estimators.ADVANTAGE_ESTIMATORS` (a test keeps them equal).
EstimatorName = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "gae"]


class KLConfig(BaseModel):
    """KL to the reference model: the per-token estimate recorded, and the penalty in the reward."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    in_reward: bool = False
    """PPO style: token reward -beta * kl_t, plus R on the last token (needs rollouts + reference)."""
    beta: float = Field(0.05, ge=0, allow_inf_nan=False)
    """KL coefficient of this batch (the PPO preset's 0.05)."""
    estimator: Literal["k1", "k2", "k3"] = "k1"
    """Per-token KL estimator, of the `kl` column and of the reward penalty (k1 for PPO)."""
    controller: Literal["fixed", "adaptive"] = "fixed"
    """'fixed' keeps beta; 'adaptive' (Ziegler et al. 2019) puts the next beta in extra.kl_beta_next."""
    target: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Target KL per sequence for the adaptive controller."""
    horizon: int = Field(10000, gt=0)
    """Horizon (in samples) of the adaptive controller."""

    @model_validator(mode="after")
    def _target_for_adaptive(self) -> KLConfig:
        if self.controller == "adaptive" and self.target is None:
            raise ValueError("kl.controller='adaptive' needs kl.target (the target KL per sequence)")
        return self


class AdvantageConfig(StageConfig):
    """Advantage stage: scores (+ rollouts, + reference log-probs / critic values) -> advantages."""

    scores: Annotated[Path, Input("scores")]
    """Input scores artifact."""
    output: Annotated[Path, Output("advantages")]
    """Output advantages artifact directory."""
    rollouts: Annotated[Path | None, Input("rollouts")] = None
    """Input rollouts artifact (behaviour log-probs); needed for any KL (kl.in_reward, kl column)."""
    reference: Annotated[Path | None, Input("reference")] = None
    """Input reference artifact (reference log-probs and/or critic values); gae needs its values."""
    estimator: EstimatorName = "grpo"
    """Advantage estimator (registry name): grpo, dr_grpo, rloo, reinforce_pp_baseline, gae."""
    std: Literal["sample", "population"] = "sample"
    """grpo: std of a group with n - 1 ('sample', as TRL and verl) or n ('population')."""
    scale: Literal["group", "batch", "none"] = "group"
    """grpo: divide by the group's std, the batch's std, or not at all."""
    eps: float = Field(1e-6, gt=0, allow_inf_nan=False)
    """grpo / reinforce_pp_baseline / gae: added to the std before dividing."""
    gamma: float = Field(1.0, ge=0, le=1)
    """gae: discount gamma."""
    lam: float = Field(0.95, ge=0, le=1)
    """gae: GAE lambda."""
    whiten: bool = True
    """gae: whiten the advantages over the masked batch (returns stay unwhitened)."""
    kl: KLConfig = KLConfig()
    """KL estimate and KL-in-reward settings."""
    seed: int = 0
    """Seed (the estimators are deterministic; kept for the common config shape)."""

    @model_validator(mode="after")
    def _inputs_for_options(self) -> AdvantageConfig:
        if self.kl.in_reward and (self.rollouts is None or self.reference is None):
            raise ValueError("kl.in_reward needs both `rollouts` (behaviour log-probs) and `reference`")
        if self.estimator == "gae" and self.reference is None:
            raise ValueError("estimator 'gae' needs `reference`: an artifact with critic values")
        return self
