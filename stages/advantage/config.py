"""Config of the advantage stage (no heavy imports)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from rlpipe.schemas.config import ImportRef, Input, Output, StageConfig, Variant, name_shorthand

StdKind = Literal["sample", "population"]
ScaleKind = Literal["group", "batch", "none"]

KLEstimator = Literal["k1", "k2", "k3", "abs", "k3+"]
"""The per-token KL estimators (kl.py): the one list of their names, for every config that picks one."""

STD_EPS = 1e-6
"""eps of `x / (std + eps)`: keeps a division by a (near-)zero standard deviation finite."""


# ---------------------------------------------------------------------------------------------
# Estimators: one variant per algorithm, each registered with its function in estimators.py
# (`@register_estimator(<variant>)`; a test keeps the tags equal to the registry's names).
# ---------------------------------------------------------------------------------------------
class _Estimator(Variant):
    needs_values: ClassVar[bool] = False
    """True when the estimator reads critic values (a reference artifact with `values`)."""
    needs_baselines: ClassVar[bool] = False
    """True when the estimator reads the greedy baseline rows (rollout `greedy_baseline: true`)."""


class GRPOEstimator(_Estimator):
    """GRPO (Shao et al. 2024): A_i = (r_i - mean_g) / (std_g + eps), the same on every token."""

    name: Literal["grpo"] = "grpo"
    """Estimator name."""
    std: StdKind = "sample"
    """Std of a group with n - 1 ('sample', as TRL and verl) or n ('population')."""
    scale: ScaleKind = "group"
    """Divide by the group's std, the batch's std, or not at all."""
    eps: float = Field(STD_EPS, gt=0, allow_inf_nan=False)
    """Added to the std before dividing."""


class DrGRPOEstimator(_Estimator):
    """Dr. GRPO (Liu et al. 2025): A_i = r_i - mean_g (no std scaling)."""

    name: Literal["dr_grpo"] = "dr_grpo"
    """Estimator name."""


class RLOOEstimator(_Estimator):
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j over the group."""

    name: Literal["rloo"] = "rloo"
    """Estimator name."""


class ReinforcePPBaselineEstimator(_Estimator):
    """REINFORCE++-baseline (Hu et al. 2025): r_i - mean_g on every token, whitened over the batch."""

    name: Literal["reinforce_pp_baseline"] = "reinforce_pp_baseline"
    """Estimator name."""
    eps: float = Field(STD_EPS, gt=0, allow_inf_nan=False)
    """Added to the batch std before dividing."""


class ReinforcePPEstimator(_Estimator):
    """REINFORCE++ (Hu et al. 2025): discounted token returns G_t = sum_{s >= t} gamma^(s-t) r_s,
    whitened over all response tokens of the batch."""

    name: Literal["reinforce_pp"] = "reinforce_pp"
    """Estimator name."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount gamma of the token returns (1: every token gets the sum of the rewards after it)."""
    eps: float = Field(STD_EPS, gt=0, allow_inf_nan=False)
    """Added to the batch std before dividing."""


class ReMaxEstimator(_Estimator):
    """ReMax (Li et al. 2024): A_i = r_i - r_greedy, the reward of the greedy response to the same
    prompt as the baseline, on every token (needs rollouts made with `greedy_baseline: true`)."""

    needs_baselines: ClassVar[bool] = True
    name: Literal["remax"] = "remax"
    """Estimator name."""


class GAEEstimator(_Estimator):
    """GAE (Schulman et al. 2016) on critic values: A_t = delta_t + gamma * lam * A_{t+1}."""

    needs_values: ClassVar[bool] = True
    name: Literal["gae"] = "gae"
    """Estimator name."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount gamma."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda."""
    whiten: bool = True
    """Whiten the advantages over the masked batch (returns stay unwhitened)."""
    eps: float = Field(STD_EPS, gt=0, allow_inf_nan=False)
    """Added to the std when whitening."""


class CustomEstimator(_Estimator):
    """A user estimator `fn(inputs, **kwargs) -> advantages`, imported from `function`.

    `inputs` is an `rlpipe.stages.advantage.estimators.AdvantageInputs` (float64 tensors; B
    responses, T = longest response): rewards (B,), group_ids (B,) int64, mask (B, T) with 1.0 on
    real tokens, token_rewards (B, T), values (B, T) or None. `fn` returns the advantages: a (B,)
    tensor (one per response, put on each of its tokens) or a (B, T) tensor (per token; padding is
    zeroed). Anything else stops the stage with an error naming `function`.
    """

    name: Literal["custom"] = "custom"
    """Estimator name."""
    function: ImportRef
    """Import path 'package.module:function' of the estimator (importable where the stage runs)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed on every call (JSON-able; recorded in the artifact)."""


EstimatorConfig = Annotated[
    GRPOEstimator | DrGRPOEstimator | RLOOEstimator | ReinforcePPBaselineEstimator | ReinforcePPEstimator
    | ReMaxEstimator | GAEEstimator | CustomEstimator,
    Field(discriminator="name"),
    BeforeValidator(name_shorthand),
]
"""An advantage estimator and its knobs: `{name: gae, lam: 0.9}`, or just its name (`rloo`)."""


class KLConfig(BaseModel):
    """KL to the reference model: the per-token estimate recorded, and the penalty in the reward."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    in_reward: bool = False
    """PPO style: token reward -beta * kl_t, plus R on the last token (needs rollouts + reference)."""
    beta: float = Field(0.05, ge=0, allow_inf_nan=False)
    """KL coefficient of this batch (the PPO preset's 0.05)."""
    estimator: KLEstimator = "k1"
    """Per-token KL estimator, of the `kl` column and of the reward penalty (k1 for PPO): k1, k2,
    k3, abs or k3+ (k3's value; its k2 gradient plays no part here, the reward is not differentiated)."""
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
    """Input rollouts artifact (behaviour log-probs); needed for any KL (kl.in_reward, kl column)
    and for episodes (multi-turn rollouts): its response_mask keeps the environment's tokens out of
    every estimate (without it they count as sampled)."""
    reference: Annotated[Path | None, Input("reference")] = None
    """Input reference artifact (reference log-probs and/or critic values); gae needs its values."""
    estimator: EstimatorConfig = GRPOEstimator()
    """Advantage estimator and its knobs, `{name: ..., <knob>: ...}` or a bare name; name: grpo,
    dr_grpo, rloo, reinforce_pp_baseline, reinforce_pp, remax, gae, custom (a user function)."""
    kl: KLConfig = KLConfig()
    """KL estimate and KL-in-reward settings."""
    seed: int = 0
    """Seed (the estimators are deterministic; kept for the common config shape)."""

    @model_validator(mode="after")
    def _inputs_for_options(self) -> AdvantageConfig:
        if self.kl.in_reward and (self.rollouts is None or self.reference is None):
            raise ValueError("kl.in_reward needs both `rollouts` (behaviour log-probs) and `reference`")
        if self.estimator.needs_values and self.reference is None:
            raise ValueError(f"estimator {self.estimator.name!r} needs `reference`: an artifact with critic values")
        return self
