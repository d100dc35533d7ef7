"""Score stage: rollouts -> scores. One scores shard per rollouts shard, same file name.

    python -m rlpipe.stages.score -c score.yaml                         # one process
    python -m rlpipe.stages.score -c score.yaml worker_count=2 worker_index=0   # } N processes;
    python -m rlpipe.stages.score -c score.yaml worker_count=2 worker_index=1   # } the last commits

Each row gets R = sum_k w_k * r_k and one `reward__<name>` column per component. A failing
component stops the stage with a `ScoreError` naming component, shard and row; no manifest is
written then, and the next run replaces the shards left behind.

Scale-out (as the rollout stage): worker i of N (worker_index=i, worker_count=N) scores the
rollouts shards k with k % N == i into the shared output directory, then drops a marker file; the
worker that finds all N markers of this cache key and every shard present writes the manifest.
A worker that is not last returns a manifest of its own shards (not written; `extra.partial`).
Batches never cross a shard, so a shard's bytes do not depend on which worker wrote it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rlpipe.schemas import (
    ROLLOUTS,
    SCORES,
    ArtifactError,
    ArtifactWriter,
    Manifest,
    read_manifest,
    read_shard,
)
from rlpipe.schemas.manifest import InputRef
from rlpipe.schemas.rollouts import sampled_lengths
from rlpipe.stages.common.progress import progress
from rlpipe.stages.common.stage_io import StageStart, opens
from rlpipe.stages.score.config import ScoreConfig
from rlpipe.stages.score.core import combine
from rlpipe.stages.score.scorers import Rows, ScoreError, build_scorer, run_scorer

STAGE = "score"
#: Identity columns a scores row copies from its rollouts row: the join key (the schemas') + run, prompt_id.
KEYS = ("run", "prompt_id", *SCORES.key)
READ = (*KEYS, "prompt", "answer", "response", "response_token_ids", "finish_reason", "metadata", "response_mask",
        "turns", "environment_reward")


def shard_index(name: str) -> int:
    """5 for 'part-00005.parquet'."""
    return int(Path(name).stem.rsplit("-", 1)[1])


def _reward_models(config: ScoreConfig) -> dict[str, InputRef]:
    """The reward-model checkpoints of the components, checked: they enter the key by content."""
    from rlpipe.stages.common.models import checkpoint_key
    from rlpipe.stages.reward_model.modeling import RewardCheckpointError, check_reward_checkpoint

    models = {}
    for c in config.components:
        if c.type == "reward_model":
            try:
                check_reward_checkpoint(c.checkpoint)
            except RewardCheckpointError as e:
                raise ScoreError(c, None, "", str(e)) from None
            models[f"reward_model:{c.name}"] = InputRef(path=str(c.checkpoint), content_hash=checkpoint_key(c.checkpoint))
    return models


@opens(STAGE, extra_inputs=_reward_models)
def run(config: ScoreConfig, start: StageStart) -> Manifest:
    """Score the rollouts (all shards, or this worker's); returns the manifest (or, for one of N
    workers, an uncommitted manifest describing the shards it wrote)."""
    inputs, key = start.inputs, start.key
    started = start.started

    extra_columns = [SCORES.families[0].column(c.name, f"{c.type} component, weight {c.weight}")
                     for c in config.components]
    writer = ArtifactWriter(config.output, SCORES, stage=STAGE, config=config.resolved(), inputs=inputs,
                            cache_key=key, extra_columns=extra_columns, clean=config.worker_index is None)
    listing = read_manifest(config.rollouts)
    names, entries = listing.shard_names, {f.name: f for f in listing.files}  # (every shard checked against one manifest)
    mine = names
    if config.worker_index is not None:
        mine = [n for n in names if shard_index(n) % config.worker_count == config.worker_index]
        writer.prepare_worker(config.worker_index, config.worker_count, others=set(names) - set(mine))

    # Score shard by shard: read, run every component (checked), write the scores shard.
    scorers = [build_scorer(c) for c in config.components]
    written = []
    with progress(f"score{config.worker_label()}: shards", len(mine)) as advance:
        for name in mine:
            table = read_shard(config.rollouts / name, ROLLOUTS, columns=READ, info=entries[name])
            rows = _rows(config.rollouts / name, table, chat=listing.extra.get("sampled_by", {}).get("chat_template", False))
            values = [run_scorer(c, s, rows) for c, s in zip(config.components, scorers, strict=True)]
            written.append(writer.write_shard(_scores_table(table, rows, config, values), shard_index(name)))
            advance()

    if config.worker_index is None:
        return _commit(writer, config, names, started)
    return writer.finish_worker(config.worker_index, config.worker_count, expected=names,
                                commit=lambda: _commit(writer, config, names, started))


def _rows(shard: Path, table: pa.Table, *, chat: bool = False) -> Rows:
    positions = pc.list_value_length(table.column("response_token_ids")).to_pylist()
    sampled = sampled_lengths(table.column("response_mask"), positions, what=f"{shard}: column 'response_mask'")
    episodes = table.column("turns").null_count < table.num_rows
    return Rows(
        shard=shard,
        prompts=table.column("prompt").to_pylist(),
        responses=table.column("response").to_pylist(),
        answers=table.column("answer").to_pylist(),
        lengths=np.array(sampled, dtype=np.int64),  # the tokens the model sampled
        group_ids=table.column("group_id").to_pylist(),
        sample_indices=table.column("sample_index").to_pylist(),
        metadata=_metadata(shard, table),
        turns=table.column("turns").to_pylist() if episodes else None,
        response_ids=table.column("response_token_ids").to_pylist(),
        chat=chat,
        environment_rewards=table.column("environment_reward").to_pylist() if episodes else None,
    )


def _metadata(shard: Path, table: pa.Table) -> list[dict[str, Any]]:
    """The rows' metadata JSON objects, parsed once per shard ({} where null)."""
    import json

    out = []
    for i, text in enumerate(table.column("metadata").to_pylist()):
        try:
            value = json.loads(text) if text is not None else {}
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{shard}, row {i}: column 'metadata' is not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ArtifactError(f"{shard}, row {i}: column 'metadata' holds a JSON {type(value).__name__}, "
                                "not an object")
        out.append(value)
    return out


def _scores_table(table: pa.Table, rows: Rows, config: ScoreConfig, values: list[np.ndarray]) -> dict[str, Any]:
    total = combine([c.weight for c in config.components], values)
    cols: dict[str, Any] = {k: table.column(k) for k in KEYS}
    cols["response_length"] = pc.list_value_length(table.column("response_token_ids")).cast(pa.int32())
    cols["finish_reason"] = table.column("finish_reason")
    cols["reward"] = pa.array(total.astype(np.float32))
    cols["sampled_tokens"] = pa.array(rows.lengths.astype(np.int32))
    for c, v in zip(config.components, values, strict=True):
        cols[f"reward__{c.name}"] = pa.array(v.astype(np.float32))
    return cols


def _commit(writer: ArtifactWriter, config: ScoreConfig, names: list[str], started: float) -> Manifest:
    """Check every scores shard against its rollouts shard (row count), then write the manifest
    with the mean of the total and of each component."""
    in_rows = {f.name: f.rows for f in read_manifest(config.rollouts).files}
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    total_rows = 0
    for n in names:
        path = writer.staging / n
        info = writer.written(n)  # (a shard this process wrote: its rows known, its table in memory)
        rows = info.rows if info is not None else pq.ParquetFile(path).metadata.num_rows
        if rows != in_rows[n]:
            raise ArtifactError(f"{path}: row count differs from {config.rollouts / n}; rerun the stage")
        t = read_shard(path, SCORES, columns=["reward", *(f"reward__{c.name}" for c in config.components)], info=info)
        total_rows += t.num_rows
        for col in t.column_names:  # (a row a TRL-style component left out, NaN, is not in its mean)
            values = t.column(col).to_numpy().astype(np.float64)
            kept = ~np.isnan(values)
            sums[col] = sums.get(col, 0.0) + float(values[kept].sum())
            counts[col] = counts.get(col, 0) + int(kept.sum())
    extra = {f"{k}_mean": v / counts[k] for k, v in sums.items() if counts[k]} if total_rows else {}
    return writer.commit(extra=extra, wall_time_s=time.time() - started)

