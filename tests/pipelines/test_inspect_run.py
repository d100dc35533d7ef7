"""`rlpipe inspect` on a real run: readable at 80 columns, the report's numbers, no false flags,
and sample completions with their rewards."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlpipe.pipelines.inspect import run_summary
from rlpipe.pipelines.report import run_table, sample_completions


def _inspect(*args, columns: int = 80) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run([sys.executable, "-m", "rlpipe.pipelines.cli", "inspect", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=120)


def test_run_summary_is_the_report_summary(mini_run):
    summary, table = run_summary(mini_run.run_dir), run_table(mini_run.run_dir)
    shared = [c for c in table.columns if c in summary.columns]
    assert {"iteration", "reward_mean", "entropy", "response_length", "eval_accuracy"} <= set(shared)
    assert summary.select(shared).to_dicts() == table.select(shared).to_dicts()
    assert summary["rollouts"].to_list() == [16, 16] and summary["groups"].to_list() == [4, 4]
    seconds = [c for c in table.columns if c.startswith("seconds_")]
    assert summary["wall_s"].to_list() == pytest.approx(table.select(seconds).sum_horizontal().to_list())
    # (the train state on its cadence: the default 10 iterations, and the last one)
    assert summary["artifacts"].to_list() == ["advantages eval metrics policy rollouts scores",
                                              "advantages eval metrics policy rollouts scores train_state"]


def test_inspect_run_fits_80_columns(mini_run):
    r = _inspect(mini_run.run_dir)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    too_wide = [line for line in lines if len(line) > 80 and not line.startswith(str(mini_run.run_dir))]
    assert not too_wide, "\n".join(too_wide)
    assert "!" not in r.stdout.split("artifacts per iteration", 1)[1].split("\n", 1)[1]  # no false flags
    assert "configs" not in r.stdout
    # every summary value is printed, in a column no narrower than its header
    table = run_summary(mini_run.run_dir)
    entropy = f"{table['entropy'][1]:.4g}"
    assert any(line.split("│")[1:2] == ["    2 "] and entropy in line for line in lines), r.stdout


def test_inspect_samples_prints_completions_with_rewards(mini_run):
    r = _inspect(mini_run.run_dir, "--samples", 3, "--iteration", 2)
    assert r.returncode == 0, r.stderr
    assert "iteration 2 (iter_0001), 3 completion(s)" in r.stdout
    samples = sample_completions(mini_run.run_dir, 1, n=3)
    rows = [line for line in r.stdout.splitlines() if line.startswith("│ ")]
    assert len(rows) == 3  # the tiny model's 3-token responses fit one line each
    for line, (prompt, _, reward, answer, _) in zip(rows, samples.iter_rows(), strict=True):
        cells = [c.strip() for c in line.strip("│").split("│")]
        assert cells[0] == prompt and cells[2] == f"{reward:.4g}" and cells[3] == answer
    r = _inspect(mini_run.run_dir, "--samples", 2, "--iteration", 7)
    assert r.returncode == 1 and "iteration 7 has no rollouts; iterations with rollouts: [1, 2]" in r.stderr
