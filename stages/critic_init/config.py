"""Config of the critic_init stage: policy checkpoint -> critic checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from rlpipe.schemas.config import Input, Output, Runtime, StageConfig
from rlpipe.stages.common.model_loading import ModelLoading


class CriticInitConfig(StageConfig):
    """Build a critic from a policy: the policy's backbone with a scalar head (V_t at the position
    before response token t), saved as scalar_head.py describes."""

    policy: Annotated[Path, Input("checkpoint")]
    """Policy checkpoint whose backbone the critic starts from."""
    output: Annotated[Path, Output("checkpoint")]
    """Where the critic checkpoint goes (with the policy's tokenizer)."""
    loading: Annotated[ModelLoading, Runtime()] = ModelLoading()
    """How the stage loads its models (trust_remote_code, attn_implementation); in a preset,
    `model.loading` sets it for every stage. Not part of the cache key."""
    head: Literal["zero", "normal"] = "zero"
    """Value-head initialisation: 'zero' (V = 0 everywhere at the start) or 'normal' (std
    1 / (hidden + 1), as OpenRLHF)."""
    seed: int = 0
    """Seeds the head's initialisation."""
