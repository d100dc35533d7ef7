"""`python -m rlpipe.stages.sft ... 2> file`: a log file (Slurm, nohup) shows progress and a summary."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from rlpipe.schemas import read_manifest
from rlpipe.stages.base_model.run import make_base_checkpoint
from rlpipe.stages.task.arithmetic import (
    ArithmeticTask,
    make_splits,
    tokenizer_texts,
    write_prompts,
)

TASK = ArithmeticTask(a_range=(0, 9), b_range=(0, 9))
STEPS = 20


def test_progress_lines_and_summary_in_a_log_file(tmp_path):
    train, _ = make_splits(TASK, 40, 0, seed=0)
    write_prompts(tmp_path / "prompts", train, split="train", task=TASK, seed=0)
    make_base_checkpoint(tmp_path / "base", tokenizer_texts(TASK), size="micro", seed=0)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(TMPDIR=str(tmp), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    log = tmp_path / "sft.err"
    with log.open("w") as err:
        done = subprocess.run(
            [sys.executable, "-m", "rlpipe.stages.sft", f"base={tmp_path / 'base'}",
             f"prompts={tmp_path / 'prompts'}", f"output={tmp_path / 'sft'}", f"max_steps={STEPS}",
             "batch_size=8", "lr=1e-2", "warmup_steps=2"],
            stdout=subprocess.PIPE, stderr=err, env=env, text=True, timeout=600)
    text = log.read_text()
    assert done.returncode == 0, text[-3000:]
    # One line per 10% of the steps (2 steps each here) and the final one, with the loss.
    progress = re.findall(r"^sft: (\d+)/(\d+) \(\d+%\) .* it/s, elapsed \S+.*loss=(\S+)$", text, re.M)
    assert [int(done) for done, _, _ in progress] == list(range(2, STEPS + 1, 2)), text[-3000:]
    assert {int(total) for _, total, _ in progress} == {STEPS}
    # The summary line: first and final loss, as in the manifest.
    extra = read_manifest(tmp_path / "sft").extra
    summary = re.findall(r"^sft: 20 steps on \d+ examples, loss (\S+) -> (\S+) \(final\)", text, re.M)
    assert summary == [(f"{extra['first_loss']:.4f}", f"{extra['final_loss']:.4f}")]
    assert float(progress[-1][2]) == float(f"{extra['final_loss']:.4g}")
    assert list(tmp.iterdir()) == []  # no process-group store left behind
