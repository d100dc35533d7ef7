"""Config of the reference stage: rollouts -> per-token reference log-probs and critic values."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from rlpipe.schemas.config import Assigned, Input, Output, StageConfig


class ReferenceConfig(StageConfig):
    """Reference stage: rollouts -> per-token reference log-probs and/or critic values."""

    rollouts: Annotated[Path, Input("rollouts")]
    """Input rollouts artifact."""
    output: Annotated[Path, Output("reference")]
    """Output reference artifact directory (one shard per rollouts shard, same index)."""
    reference_model: Annotated[Path | None, Input("checkpoint")] = None
    """Frozen reference checkpoint (causal LM, Hugging Face format) for `ref_logprobs`."""
    critic: Annotated[Path | None, Input("checkpoint")] = None
    """Critic checkpoint (token classification, one label) for `values`."""
    batch_size: int = Field(32, ge=1)
    """Sequences per forward pass."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to run the forward passes; 'auto' takes CUDA when available."""
    seed: int = 0
    """Seed (forward passes are deterministic; kept for the common config shape)."""
    worker_index: Annotated[int | None, Assigned()] = Field(None, ge=0)
    """None: this process computes every shard and writes the manifest. An int i: worker i of
    `worker_count` computes the rollouts shards k with k % worker_count == i into the shared
    output directory; the worker that finishes last writes the manifest listing all shards."""
    worker_count: Annotated[int, Assigned()] = Field(1, ge=1)
    """Number of processes sharing the artifact (see worker_index)."""

    @model_validator(mode="after")
    def _something_to_do(self) -> ReferenceConfig:
        if self.reference_model is None and self.critic is None:
            raise ValueError("set `reference_model` and/or `critic`: there is nothing to compute")
        if self.worker_index is not None and self.worker_index >= self.worker_count:
            raise ValueError(f"worker_index {self.worker_index} must be < worker_count {self.worker_count}")
        if self.worker_index is None and self.worker_count != 1:
            raise ValueError("worker_count > 1 needs a worker_index (0..worker_count-1) per process")
        return self

    def work_key(self) -> dict[str, Any]:
        """The config minus how the work is split: equal for 1 process and for N workers."""
        return self.model_dump(mode="json", exclude={"worker_count", "worker_index"})
