"""Config of the reward-model stage: Bradley-Terry training of a scalar-head model on preferences."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from rlpipe.schemas.config import Assigned, Input, Output, Runtime, StageConfig
from rlpipe.stages.common.model_loading import ModelLoading


class RewardModelConfig(StageConfig):
    """Train a Bradley-Terry reward model (scalar head, reward at the last token) with DeepSpeed."""

    preferences: Annotated[Path, Input("preferences")]
    """Input `preferences` artifact (pair_id, prompt, chosen, rejected, optional margin)."""
    base: Annotated[Path, Input("checkpoint")]
    """Hugging Face checkpoint to start from: a causal LM (a fresh 1-label `score` head is added,
    initialised from `seed`) or a 1-label sequence-classification model."""
    output: Annotated[Path, Output("checkpoint")]
    """Directory of the trained reward-model checkpoint (Hugging Face format + `_manifest.json`)."""
    loading: Annotated[ModelLoading, Runtime()] = ModelLoading()
    """How the stage loads its models (trust_remote_code, attn_implementation); in a preset,
    `model.loading` sets it for every stage. Not part of the cache key."""
    metrics_output: Annotated[Path | None, Output("metrics")] = None
    """Output `metrics` artifact (loss per step, held-out accuracy, reward mean/std);
    default: `<output>_metrics` beside the checkpoint."""
    run: Annotated[str, Assigned()] = "reward_model"
    """Run name written into the metrics rows."""
    iteration: Annotated[int, Assigned()] = Field(0, ge=0)
    """Iteration written into the metrics rows."""
    packing: Annotated[bool, Runtime()] = True
    """Padding-free forward passes (each pair's sequences back to back, attention confined to each:
    stages/common/forward.py) where the architecture takes them; else padded. The same rewards up
    to float rounding. Not part of the cache key."""
    seed: int = 0
    """Seeds the head initialisation, the held-out split and the data order."""
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    """Fraction of pairs held out for evaluation (chosen by a seeded hash of pair_id, so the split
    does not depend on row order); 0 disables evaluation."""
    epochs: int = Field(1, ge=1)
    """Passes over the training pairs."""
    batch_size: int = Field(16, ge=1)
    """Pairs per micro-batch per rank (each pair is two sequences in one forward pass)."""
    gradient_accumulation: int = Field(1, ge=1)
    """Micro-batches per optimizer step (global batch = batch_size x accumulation x ranks)."""
    lr: float = Field(1e-5, gt=0.0, allow_inf_nan=False)
    """AdamW learning rate (constant)."""
    weight_decay: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    """Gradient clipping norm (0 disables)."""
    max_length: int = Field(512, ge=2)
    """Token budget of prompt+response; longer sequences keep their last `max_length` tokens
    (the reward is read at the last token, so the end must survive)."""
    use_margin: bool = True
    """Use the per-pair `margin` column in -log sigmoid(r_c - r_r - m); false: m = 0."""
    center_coef: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    """Coefficient c of the centering term c * mean((r_c + r_r)^2); 0 disables it."""
    zero_stage: Literal[0, 1, 2, 3] = 0
    """DeepSpeed ZeRO stage."""
    eval_batch_size: int = Field(64, ge=1)
    """Pairs per forward pass during evaluation."""
