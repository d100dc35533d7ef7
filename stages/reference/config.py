"""Config of the reference stage: rollouts -> per-token reference log-probs and critic values."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from rlpipe.schemas.config import Input, Output, Runtime
from rlpipe.schemas.sharded import ShardedConfig
from rlpipe.stages.common.model_loading import ComputeDtype, ModelLoading


class ReferenceConfig(ShardedConfig):
    """Reference stage: rollouts -> per-token reference log-probs and/or critic values."""

    rollouts: Annotated[Path, Input("rollouts")]
    """Input rollouts artifact."""
    output: Annotated[Path, Output("reference")]
    """Output reference artifact directory (one shard per rollouts shard, same index)."""
    loading: Annotated[ModelLoading, Runtime()] = ModelLoading()
    """How the stage loads its models (trust_remote_code, attn_implementation); in a preset,
    `model.loading` sets it for every stage. Not part of the cache key."""
    reference_model: Annotated[Path | None, Input("checkpoint")] = None
    """Frozen reference checkpoint (causal LM, Hugging Face format) for `ref_logprobs`."""
    critic: Annotated[Path | None, Input("checkpoint")] = None
    """Critic checkpoint (token classification, one label) for `values`."""
    batch_size: int = Field(32, ge=1)
    """Sequences per forward pass (at most)."""
    max_tokens_per_batch: Annotated[int | None, Runtime()] = Field(None, ge=1)
    """Tokens (prompt + response) per forward pass at most, beside `batch_size` (a longer row goes
    alone); None: `batch_size` rows whatever their lengths. Not part of the cache key."""
    packing: Annotated[bool, Runtime()] = True
    """Padding-free forward passes (a batch's sequences back to back, attention confined to each)
    where the architecture takes them (stages/common/forward.py); else padded rows. The same numbers
    up to float rounding. Not part of the cache key."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to run the forward passes; 'auto' takes CUDA when available."""
    dtype: ComputeDtype = "auto"
    """What the stage computes in (both models; the log-probs are summed in fp32): 'auto' (bf16 where CUDA is present, else fp32), 'fp32' or
    'bf16'; in a preset, `model.dtype` sets it for every stage that loads a model."""
    seed: int = 0
    """Seed (forward passes are deterministic; kept for the common config shape)."""

    @model_validator(mode="after")
    def _something_to_do(self) -> ReferenceConfig:
        if self.reference_model is None and self.critic is None:
            raise ValueError("set `reference_model` and/or `critic`: there is nothing to compute")
        return self
