"""Config of the evaluate stage: held-out prompts + checkpoint -> eval metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from rlpipe.schemas.config import Assigned, Input, Output, Runtime, StageConfig
from rlpipe.stages.common.model_loading import ComputeDtype, ModelLoading
from rlpipe.stages.rollout.environments.base import EnvironmentSpec


class EvaluateConfig(StageConfig):
    """Greedy-decode every held-out prompt once with the checkpoint (the rollout stage with G=1,
    temperature 0; in a pipeline with the rollout's lengths, stop strings, environment, engine,
    chat template and system prompt, and the score's answer_match mode, unless the evaluate section
    sets its own), score the responses against the reference answers (the score stage's
    answer_match component) and write a `metrics` artifact: accuracy, mean reward, response length.
    The eval rollouts and scores are kept in `<output>/rollouts` and `<output>/scores`."""

    checkpoint: Annotated[Path, Input("checkpoint")]
    """Policy checkpoint to evaluate (Hugging Face directory)."""
    prompts: Annotated[Path, Input("prompts")]
    """Held-out `prompts` artifact; every row needs an answer."""
    output: Annotated[Path, Output("metrics")]
    """Output `metrics` artifact directory (eval rollouts/scores go in subdirectories of it)."""
    loading: Annotated[ModelLoading, Runtime()] = ModelLoading()
    """How the stage loads its models (trust_remote_code, attn_implementation); in a preset,
    `model.loading` sets it for every stage. Not part of the cache key."""
    run: Annotated[str, Assigned()] = "run"
    """Run name recorded in the rows."""
    iteration: Annotated[int, Assigned()] = Field(0, ge=0)
    """Iteration recorded in the rows (the policy version evaluated)."""
    max_new_tokens: int = Field(8, ge=1)
    """Response length limit."""
    stop: tuple[str, ...] = ()
    """Stop strings of the rollout (as rollout.stop)."""
    environment: EnvironmentSpec | None = None
    """Evaluate greedy episodes with this environment (as rollout.environment); the answer is the
    last model turn's."""
    chat_template: bool | Literal["auto"] = "auto"
    """Apply the tokenizer's chat template to every prompt (as rollout.chat_template)."""
    system_prompt: str | None = None
    """A system turn put first in every templated prompt (as rollout.system_prompt)."""
    match: Literal["exact", "numeric", "math"] = "exact"
    """answer_match mode: 'exact' (normalised string equality), 'numeric' (last number) or 'math'
    (LaTeX answers through math-verify; the `math` extra)."""
    engine: Literal["transformers", "vllm"] = "transformers"
    """Generation engine of the rollout stage."""
    dtype: ComputeDtype = "auto"
    """What the stage computes in: 'auto' (bf16 where CUDA is present, else fp32), 'fp32' or
    'bf16'; in a preset, `model.dtype` sets it for every stage that loads a model."""
    batch_size: int = Field(256, ge=1)
    """Prompts per generate call."""
    keep_rollouts: bool = True
    """Keep the eval rollouts and scores artifacts (False: delete them once the metrics exist)."""
    seed: int = 0
    """Recorded (greedy decoding draws no random numbers)."""
