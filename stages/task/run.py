"""The task stage: write the arithmetic task's splits (and the SFT copy: flawed answers, tool
traces) as artifacts.

Each output is an artifact of its own (manifest last); a rerun with the same config finds them
complete and writes nothing.
"""

from __future__ import annotations

from rlpipe.schemas import Manifest, cached_manifest
from rlpipe.stages.common.stage_io import StageStart, opens
from rlpipe.stages.task import arithmetic
from rlpipe.stages.task.config import TaskConfig

STAGE = "task"


@opens(STAGE)
def run(config: TaskConfig, start: StageStart) -> Manifest:
    """Write the outputs of `config`; returns the training prompts' manifest."""
    key, outputs = start.key, config.outputs()
    task = config.to_task()
    splits = arithmetic.split_problems(task, {"train": config.n_train, "heldout": config.n_heldout}, config.seed)
    for split, problems in splits.items():
        arithmetic.write_prompts(outputs[split], problems, split=split, task=task, seed=config.seed, cache_key=key)
    if config.sft is not None:
        arithmetic.write_mixed_format_copy(config.train, config.sft, fraction=config.sft_padded_fraction,
                                           pad_from=config.sft_padded_from, seed=config.seed,
                                           tool_fraction=config.sft_tool_fraction, cache_key=key)
    return cached_manifest(config.train, key)
