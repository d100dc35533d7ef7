"""Reward-model stage: preferences + base checkpoint -> reward-model checkpoint + metrics.

    python -m rlpipe.stages.reward_model preferences=DIR base=CKPT output=OUT [key=value ...]

Reads every pair, holds out `eval_fraction` of them (seeded hash of pair_id), trains a 1-label
scalar head with the Bradley-Terry loss on DeepSpeed, and writes (rank 0):
    <output>/           Hugging Face checkpoint (safetensors + tokenizer), `_manifest.json` last
    <metrics>/          `metrics` artifact: loss per optimizer step, held-out accuracy and rewards
The checkpoint manifest is written after the metrics, so it exists only when both are complete.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from rlpipe.schemas import (
    METRICS,
    PREFERENCES,
    Manifest,
    commit_directory,
    read_manifest,
    read_table_artifact,
    write_table_artifact,
)
from rlpipe.schemas.config_files import ConfigError
from rlpipe.schemas.errors import DataError
from rlpipe.schemas.manifest import MANIFEST_NAME
from rlpipe.schemas.staging import staged_directory
from rlpipe.stages.common.stage_io import StageStart, opens
from rlpipe.stages.reward_model.config import RewardModelConfig

_log = logging.getLogger(__name__)

STAGE = "reward_model"


def metrics_path(config: RewardModelConfig) -> Path:
    """Where the metrics artifact goes: `config.metrics_output`, or `<output>_metrics` beside it."""
    return config.metrics_output or config.output.with_name(config.output.name + "_metrics")


@opens(STAGE)
def run(config: RewardModelConfig, start: StageStart) -> Manifest:
    """Train the reward model; returns the checkpoint's manifest (cached when nothing changed)."""
    from rlpipe.stages.common.deepspeed import save_pretrained
    from rlpipe.stages.common.distributed import barrier, init_distributed
    from rlpipe.stages.reward_model import engine as E
    from rlpipe.stages.reward_model.core import chance_band, near_chance, split_pairs
    from rlpipe.stages.reward_model.modeling import encode

    inputs, key = start.inputs, start.key
    started = start.started

    # Data: every pair, tokenised once; the held-out split by seeded hash of pair_id.
    table = read_table_artifact(config.preferences, PREFERENCES)
    if table.num_rows == 0:
        raise DataError(f"preferences artifact {config.preferences} has no rows")
    dist_info = init_distributed()
    rank, world_size = dist_info.rank, dist_info.world_size
    if rank == 0:  # the old outputs stop existing now: a killed run leaves nothing that looks complete
        (config.output / MANIFEST_NAME).unlink(missing_ok=True)
        (metrics_path(config) / MANIFEST_NAME).unlink(missing_ok=True)
    model, tokenizer = E.load_base(config.base, config.seed)
    prompts = table.column("prompt").to_pylist()
    margin = np.nan_to_num(table.column("margin").to_numpy(zero_copy_only=False).astype(np.float32), nan=0.0)
    data = E.PairData(
        chosen=encode(tokenizer, prompts, table.column("chosen").to_pylist(), config.max_length),
        rejected=encode(tokenizer, prompts, table.column("rejected").to_pylist(), config.max_length),
        margin=margin,
    )
    train_idx, eval_idx = split_pairs(table.column("pair_id").to_pylist(), config.eval_fraction, config.seed)
    if len(train_idx) < config.batch_size * world_size and world_size > 1:
        raise ConfigError(f"{len(train_idx)} training pairs cannot fill one batch on {world_size} ranks")

    # Train on DeepSpeed.
    engine, history = E.train(model, tokenizer, data.take(train_idx), data.take(eval_idx), config,
                              rank, world_size)

    # Write (rank 0): checkpoint files, metrics artifact, then the checkpoint manifest last, all
    # staged: the checkpoint at config.output is replaced only once the new one is complete.
    with staged_directory(config.output, write=rank == 0) as out:
        save_pretrained(engine, tokenizer, out, rank, part=lambda module: module.model)  # collective
        if rank == 0:
            metrics = {
                "run": [config.run] * len(history.rows),
                "iteration": [config.iteration] * len(history.rows),
                "stage": [STAGE] * len(history.rows),
                "step": [s for s, _, _ in history.rows],
                "name": [n for _, n, _ in history.rows],
                "value": [v for _, _, v in history.rows],
            }
            write_table_artifact(metrics_path(config), METRICS, metrics, stage=STAGE,
                                 config=config.resolved(), inputs=inputs, cache_key=key)
            final = {n: v for _, n, v in history.rows}  # last value of each metric
            summary = {"train_pairs": len(train_idx), "eval_pairs": len(eval_idx), "world_size": world_size,
                       "steps": max((s for s, _, _ in history.rows), default=0),
                       **{k: v for k, v in final.items() if k.startswith("eval_") or k == "loss"}}
            if "eval_accuracy" in final:  # whether the held-out accuracy is within a coin's (core.chance_band)
                summary |= {"eval_chance_band": chance_band(len(eval_idx)),
                            "eval_near_chance": near_chance(final["eval_accuracy"], len(eval_idx))}
            commit_directory(out, stage=STAGE, config=config.resolved(), inputs=inputs, cache_key=key,
                             extra=summary, wall_time_s=time.time() - started)
    if rank == 0:
        accuracy = f"held-out pairwise accuracy {final['eval_accuracy']:.4f} on {len(eval_idx)} pairs" \
            if "eval_accuracy" in final else "no held-out pairs (eval_fraction=0)"
        _log.info(f"reward_model: {summary['steps']} steps on {len(train_idx)} pairs, final loss "
                  f"{final.get('loss', float('nan')):.4f}, {accuracy}")
        if summary.get("eval_near_chance"):
            _log.warning(f"reward_model: held-out pairwise accuracy {final['eval_accuracy']:.4f} is within "
                         f"chance (0.5 + {summary['eval_chance_band']:.3f}, two standard deviations of a coin on "
                         f"{len(eval_idx)} pairs): the reward model has not learnt these preferences; give it "
                         "more or clearer pairs, more epochs or another lr")
    engine.destroy()
    barrier()
    return read_manifest(config.output)
