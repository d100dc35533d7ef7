"""Configs of stages whose work N processes split by shard (rollout, score, reference).

Worker i of N (`worker_index=i, worker_count=N`) writes the shards k with k % N == i into the
shared output directory; the worker that finishes last writes the manifest listing every shard
(`ArtifactWriter.prepare_worker` / `finish_worker`). Batches never cross a shard, so a shard's
bytes do not depend on which worker wrote it, and the split is never part of the work: the
cache key and the recorded config are the same for 1 process and for N workers.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from rlpipe.schemas.config import Assigned, StageConfig

#: The fields that decide who writes which shard, never what a shard holds.
SPLIT_FIELDS = ("worker_index", "worker_count")


class ShardedConfig(StageConfig):
    """A stage config whose work `worker_count` processes can split by shard."""

    worker_index: Annotated[int | None, Assigned()] = Field(None, ge=0)
    """None: this process does every shard and writes the manifest. An int i: worker i of
    `worker_count` does the shards k with k % worker_count == i into the shared output
    directory; the worker that finishes last writes the manifest listing all shards."""
    worker_count: Annotated[int, Assigned()] = Field(1, ge=1)
    """Number of processes sharing the artifact (see worker_index)."""

    @model_validator(mode="after")
    def _check_split(self) -> ShardedConfig:
        if self.worker_index is not None and self.worker_index >= self.worker_count:
            raise ValueError(f"worker_index {self.worker_index} must be < worker_count {self.worker_count}")
        if self.worker_index is None and self.worker_count != 1:
            raise ValueError("worker_count > 1 needs a worker_index (0..worker_count-1) per process")
        return self

    def resolved(self) -> dict[str, Any]:
        """Every field but the split: what the manifest records, whichever worker commits it."""
        return {k: v for k, v in super().resolved().items() if k not in SPLIT_FIELDS}

    def worker_label(self) -> str:
        """' worker i/N' for one of N workers, '' for a single process (for messages)."""
        return "" if self.worker_index is None else f" worker {self.worker_index}/{self.worker_count}"
