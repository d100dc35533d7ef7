"""Config of the rollout stage: prompts + policy checkpoint -> rollouts (G samples per prompt)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator

from rlpipe.schemas.config import Assigned, Input, Output, Runtime
from rlpipe.schemas.sharded import ShardedConfig
from rlpipe.stages.common.model_loading import ComputeDtype, ModelLoading, torch_dtype_names
from rlpipe.stages.rollout.environments.base import EnvironmentSpec


class RolloutConfig(ShardedConfig):
    """Sample a group of G responses for every prompt with the policy and write a rollouts artifact.

    Each group's samples depend only on (seed, iteration, group_id), the checkpoint, the prompt and
    the sampling knobs: not on how groups are cut into shards, batches or workers. Stored log-probs
    are log pi_theta(token | prefix) from the policy's raw logits (temperature 1, before top-p/top-k).
    """

    checkpoint: Annotated[Path, Input("checkpoint")]
    """Policy checkpoint directory (Hugging Face format)."""
    prompts: Annotated[Path, Input("prompts")]
    """Input prompts artifact (schema `prompts`)."""
    output: Annotated[Path, Output("rollouts")]
    """Output rollouts artifact directory."""
    loading: Annotated[ModelLoading, Runtime()] = ModelLoading()
    """How the stage loads its models (trust_remote_code, attn_implementation); in a preset,
    `model.loading` sets it for every stage. Not part of the cache key."""
    run: Annotated[str, Assigned()] = "run"
    """Run name recorded in every row."""
    iteration: Annotated[int, Assigned()] = Field(0, ge=0)
    """Training iteration these rollouts belong to (recorded, and part of every group's seed)."""
    policy_version: Annotated[int, Assigned()] = Field(0, ge=0)
    """Optimisation rounds applied to the checkpoint (recorded in every row)."""
    engine: Literal["transformers", "vllm"] = "transformers"
    """Generation engine. 'vllm' needs vLLM importable (on CPU: `make vllm-env`, then run the stage
    with `.venv-vllm/bin/python -m rlpipe.stages.rollout engine=vllm ...`)."""

    group_size: int = Field(8, ge=1)
    """G: responses sampled per prompt."""
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    """Sampling temperature; 0 means greedy (argmax)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest set of tokens with probability mass >= top_p (1 = off)."""
    top_k: int = Field(0, ge=0)
    """Keep only the k most likely tokens (0 = off)."""
    max_new_tokens: int = Field(64, ge=1)
    """Response length limit; a response that reaches it ends with finish_reason 'length'."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation stops at the token that completes one; the response text is cut
    before it (the token ids and log-probs keep that token, as vLLM does)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response (kept in it, like EOS), in addition to the tokenizer's EOS."""
    chat_template: bool | Literal["auto"] = "auto"
    """Apply the tokenizer's chat template (with add_generation_prompt=True) to every prompt: its
    `messages`, or a plain `prompt` as one user turn. 'auto': when the tokenizer has a template
    (the tiny local tokenizers have none, so plain prompts stay as they are). false: plain prompts
    are tokenised as is, and prompts given as messages are refused."""
    system_prompt: str | None = None
    """A system turn put first in every templated prompt whose messages do not start with one of
    their own (needs the chat template)."""
    seed: int = Field(0, ge=0)
    """Stage seed; group g is sampled with a seed derived from (seed, iteration, g)."""
    greedy_baseline: bool = False
    """Also generate the greedy (temperature 0) response to every prompt, written first in its
    group with sample_index -1 (schemas/rollouts.py): the baseline of the `remax` estimator. It is
    scored, never trained on."""
    oversample: float = Field(1.0, ge=1.0, le=100.0, allow_inf_nan=False)
    """Dynamic sampling: generate ceil(num_prompts * oversample) groups (the next prompts in
    order), so that a `filter` stage dropping groups can still keep num_prompts of them."""

    environment: EnvironmentSpec | None = None
    """Multi-turn episodes (docs/design.md#multi-turn): the environment that answers each model turn
    ({name: tools, kwargs: {tools: [calculator]}, max_turns: 4}, or function: 'pkg.module:make').
    max_new_tokens then bounds each model turn; the environment's replies are inserted with the
    chat template (chat_template) or as raw text, and are never trained on. None: one response
    per sample."""

    num_prompts: Annotated[int | None, Assigned()] = Field(None, ge=1)
    """Groups to generate (times `oversample`): prompts taken in artifact order from
    `prompt_offset`, wrapping around the end (None = every prompt once)."""
    prompt_offset: Annotated[int, Assigned()] = Field(0, ge=0)
    """Index of the first prompt taken (modulo the prompt count): a pipeline passes
    iteration * group_count() to walk through the prompts across iterations."""
    batch_size: int = Field(16, ge=1)
    """Prompts per generate call (batch rows = batch_size * G); batches never cross a shard."""
    groups_per_shard: int = Field(64, ge=1)
    """Shard size in groups: shard k holds groups [k*S, (k+1)*S)."""

    device: str = "auto"
    """transformers engine: torch device ('auto' = cuda if available, else cpu)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """vllm engine: GPUs per engine (tensor parallelism)."""
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0)
    """vllm engine: fraction of GPU memory the engine may use."""
    dtype: Annotated[ComputeDtype | Literal["fp16"], BeforeValidator(torch_dtype_names)] = "auto"
    """What either engine computes in: 'auto' (bf16 where CUDA is present, else fp32), 'fp32',
    'bf16', or 'fp16' (vLLM on GPUs without bf16; vLLM's names float32, bfloat16, float16 are read
    as these). In a preset, `model.dtype` sets it, with the reference's, the reward models',
    evaluation's and optimize's. The sampling distribution is computed in fp32 either way."""
    max_model_len: int | None = Field(None, ge=1)
    """vllm engine: context length (None = the model's max_position_embeddings)."""

    @model_validator(mode="after")
    def _check_workers(self) -> RolloutConfig:
        if self.oversample != 1.0 and self.num_prompts is None:
            raise ValueError("oversample multiplies num_prompts: set num_prompts (None means every prompt once)")
        if self.system_prompt is not None and self.chat_template is False:
            raise ValueError("system_prompt needs the chat template: set chat_template to true or 'auto'")
        return self

    def group_count(self) -> int | None:
        """Groups generated: ceil(num_prompts * oversample) (None: every prompt once). Rounded to 9
        decimals first, so that 10 * 1.1 = 11.000000000000002 gives 11 groups, not 12."""
        if self.num_prompts is None:
            return None
        return math.ceil(round(self.num_prompts * self.oversample, 9))
