"""Config of the score stage: rollouts -> scores, R = sum_k w_k * r_k over named components."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlpipe.schemas.config import ImportRef, Input, Output, Runtime
from rlpipe.schemas.sharded import ShardedConfig
from rlpipe.stages.common.model_loading import ComputeDtype, ModelLoading


class _Component(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_]+$")
    """Component name: the output column is `reward__<name>` (letters, digits, underscores)."""
    weight: float = Field(1.0, allow_inf_nan=False)
    """Weight w_k of this component in the total R = sum_k w_k * r_k."""


class RewardModelComponent(_Component):
    """Score of a trained reward model (1-label sequence classifier) on prompt + response text."""

    type: Literal["reward_model"] = "reward_model"
    checkpoint: Path
    """Reward-model checkpoint directory (written by the reward_model stage)."""
    batch_size: int = Field(32, ge=1)
    """Sequences per forward pass (at most)."""
    max_tokens_per_batch: Annotated[int | None, Runtime()] = Field(None, ge=1)
    """Tokens (prompt + response) per forward pass at most, beside `batch_size` (a longer
    sequence goes alone): a batch of long responses bounded like one of short ones. None:
    `batch_size` sequences whatever their lengths. Not part of the cache key."""
    packing: Annotated[bool, Runtime()] = True
    """Padding-free forward passes where the architecture takes them (stages/common/forward.py);
    else padded rows. The same rewards up to float rounding. Not part of the cache key."""
    max_length: int = Field(1024, ge=2)
    """Token budget of prompt + response; longer sequences keep their last tokens."""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """'auto' (cuda when available, else cpu), 'cpu', 'cuda' or 'cuda:N'. On cpu the model comes
    from the in-process cache shared with other stages; on a GPU it is loaded for this run."""
    dtype: ComputeDtype = "auto"
    """What the reward model computes in: 'auto' (bf16 where CUDA is present, else fp32), 'fp32'
    or 'bf16'; in a preset, `model.dtype` sets it for every reward-model component."""


class AnswerMatchComponent(_Component):
    """1.0 if the answer extracted from the response matches the reference answer, else 0.0 (an
    episode's answer is in its last model turn)."""

    type: Literal["answer_match"] = "answer_match"
    mode: Literal["exact", "numeric", "math"] = "numeric"
    """'exact': equal strings after normalisation (trim, casefold, collapse whitespace, drop a
    trailing period); 'numeric': equal numbers (commas dropped, fractions a/b allowed) within the
    tolerances; 'math': the response's LaTeX answer (`\\boxed{}` first) mathematically equal to the
    reference (`\\frac{1}{2}`, `0.5`, `x^2+1`), by math-verify as TRL's accuracy reward uses it
    (the `math` extra; its own tolerances, not rel_tol / abs_tol)."""
    pattern: str | None = None
    """Regex with one capture group locating the answer in the response (last match wins).
    Default: 'numeric' takes the last number in the response; 'exact' the text after the last
    'A:' (or the whole response when there is none)."""
    rel_tol: float = Field(1e-6, ge=0.0, allow_inf_nan=False)
    """Relative tolerance of numeric equality."""
    abs_tol: float = Field(1e-9, ge=0.0, allow_inf_nan=False)
    """Absolute tolerance of numeric equality."""
    missing_answer: Literal["error", "zero"] = "error"
    """A rollout without a reference answer: 'error' stops with the row named; 'zero' scores 0."""

    @field_validator("pattern")
    @classmethod
    def _one_group(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                groups = re.compile(v).groups
            except re.error as e:
                raise ValueError(f"not a valid regex: {e}") from None
            if groups != 1:
                raise ValueError(f"needs exactly one capture group, has {groups}")
        return v

    @field_validator("mode")
    @classmethod
    def _package_for(cls, v: str) -> str:
        from rlpipe.stages.score.verifiers import math_verify_missing

        if v == "math" and (missing := math_verify_missing()) is not None:
            raise ValueError(missing)
        return v


class RegexFormatComponent(_Component):
    """1.0 if the response matches a regex (a format check), else 0.0."""

    type: Literal["regex_format"] = "regex_format"
    pattern: str
    """Python regex; use inline flags such as (?s) or (?m) where needed."""
    match: Literal["search", "fullmatch"] = "search"
    """'search': anywhere in the response; 'fullmatch': the whole response, as generated (leading
    and trailing whitespace included: allow it with \\s* where it may occur)."""

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"not a valid regex: {e}") from None
        return v


class OverlongComponent(_Component):
    """DAPO overlong shaping on the response length L in tokens: 0 if L <= L_max - L_buf,
    ((L_max - L_buf) - L) / L_buf inside the buffer, -1 beyond L_max."""

    type: Literal["overlong"] = "overlong"
    max_length: int = Field(ge=1)
    """L_max: the maximum response length in tokens (usually the rollout's max_new_tokens)."""
    buffer: int = Field(ge=1)
    """L_buf: the soft-penalty zone before L_max, in tokens."""

    @model_validator(mode="after")
    def _buffer_fits(self) -> OverlongComponent:
        if self.buffer > self.max_length:
            raise ValueError(f"buffer ({self.buffer}) must not exceed max_length ({self.max_length})")
        return self


class PythonComponent(_Component):
    """A user reward or verifier, called on batches of `batch_size` rows, in one of two styles.

    rlpipe's: `fn(prompts, responses, answers, **kwargs) -> list[float]`, three lists of equal
    length (prompt texts, response texts, reference answers or None), one finite float per row (a
    verifier: 1.0 / 0.0). A function that takes a `metadata` keyword (or **kwargs) also gets the
    rows' prompt metadata: a list of dicts, one per row ({} where the prompt has none).

    TRL's (a reward function written for TRL's GRPOTrainer, unchanged): `fn(completions, **kwargs)`
    called with every argument by keyword: `prompts`, `completions`, `completion_ids`, the rows'
    `answer` and each key of their metadata (the data set's other columns) as its own keyword, None
    where a row lacks it; prompts and completions as messages ([{role, content}]) where the rollout
    used the chat template, as TRL does for a conversational data set. It returns a float or None
    per row: None (the function does not apply to that row) adds nothing to the row's total and is
    left out of the component's mean, as in TRL.
    """

    type: Literal["python"] = "python"
    function: ImportRef
    """Import path 'package.module:function'."""
    style: Literal["auto", "rlpipe", "trl"] = "auto"
    """How the function is called: 'auto' (TRL's way when it names a `completions` parameter,
    else rlpipe's), 'rlpipe' or 'trl' for a signature that could be either."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments passed on every call (JSON-able)."""
    batch_size: int = Field(256, ge=1)
    """Rows per call."""
    timeout_s: float | None = Field(300.0, gt=0, allow_inf_nan=False)
    """Seconds one call may take; past it the stage stops with an error naming the component.
    None: no limit."""
    isolate: bool = False
    """Run the function in a worker process (spawned once per stage run): a crash, a hang or
    `sys.exit` in user code then cannot take the scoring process down. Arguments and results
    cross a pipe, so they must pickle."""


class EnvironmentComponent(_Component):
    """The reward the rollout's environment gave the episode (rollout.environment; the sum over its
    steps, 0.0 where it gave none): the rollouts' `environment_reward` column."""

    type: Literal["environment"] = "environment"


Component = Annotated[
    RewardModelComponent | AnswerMatchComponent | RegexFormatComponent | OverlongComponent | PythonComponent
    | EnvironmentComponent,
    Field(discriminator="type"),
]


class ScoreConfig(ShardedConfig):
    """Score rollouts: total reward R = sum_k w_k * r_k plus one column per component."""

    rollouts: Annotated[Path, Input("rollouts")]
    """Input `rollouts` artifact."""
    output: Annotated[Path, Output("scores")]
    """Output `scores` artifact (one shard per rollouts shard, same index)."""
    loading: Annotated[ModelLoading, Runtime()] = ModelLoading()
    """How the stage loads its models (trust_remote_code, attn_implementation); in a preset,
    `model.loading` sets it for every stage. Not part of the cache key."""
    components: list[Component] = Field(min_length=1)
    """Reward components, each {name, type, weight, ...}; type: reward_model | answer_match |
    regex_format | overlong | python | environment. On episodes (multi-turn rollouts) answer_match
    checks the last model turn's text, overlong counts the tokens the model sampled, the others see
    the whole episode's text (a python function that names a `turns` keyword also gets the turns)."""
    seed: int = 0
    """Unused by the built-in components (all deterministic); recorded for user functions."""

    @model_validator(mode="after")
    def _check(self) -> ScoreConfig:
        names = [c.name for c in self.components]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"component names must be unique; repeated: {dup}")
        return self

    def cache_dict(self) -> dict[str, Any]:
        """What decides the scores: the config without its paths (reward-model checkpoints enter
        the key by content) and without how the work is split (1 process = N workers)."""
        out = super().cache_dict()
        out["components"] = [{k: v for k, v in c.items() if k != "checkpoint"} for c in out["components"]]
        return out
