"""Reward functions written for TRL's GRPOTrainer score a whole run unchanged: the miniature preset
with TRL-style rewards in place of its answer_match (a format reward, an accuracy reward over the
dataset's `answer` column, a bonus over a metadata column and the completion ids), two GRPO
iterations; every iteration's scores equal calling the functions directly on that iteration's
rollouts, and the total is the weighted sum."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import polars as pl
import pytest
import yaml
from conftest import MINI

from rlpipe.pipelines.preset import load_preset
from rlpipe.pipelines.runner import Pipeline

pytestmark = [pytest.mark.hf, pytest.mark.integration]

USER_REWARDS = Path(__file__).resolve().parents[1] / "stages" / "score"  # user_rewards.py


def test_trl_reward_functions_score_a_run_as_direct_calls_would(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(USER_REWARDS))
    import user_rewards as U

    preset = copy.deepcopy(MINI) | {"name": "mini_trl"}
    preset["score"] = {"components": [
        {"name": "format", "type": "python", "function": "user_rewards:trl_format_reward", "weight": 0.5},
        {"name": "correct", "type": "python", "function": "user_rewards:trl_accuracy_reward"},
        {"name": "bonus", "type": "python", "function": "user_rewards:trl_operand_bonus", "weight": 2.0},
    ]}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(preset))
    run_dir = tmp_path / "runs" / "mini_trl"
    Pipeline(load_preset(tmp_path / "p.yaml"), run_dir, log=lambda s: None).run()
    for k in range(2):
        r = pl.read_parquet(run_dir / f"iter_{k:04d}" / "rollouts" / "part-*.parquet")
        s = pl.read_parquet(run_dir / f"iter_{k:04d}" / "scores" / "part-*.parquet")
        rows = r.join(s, on=["group_id", "sample_index"]).sort("group_id", "sample_index")
        completions = rows["response"].to_list()  # no chat template: plain text, as TRL passes it
        fmt = U.trl_format_reward(completions)
        correct = U.trl_accuracy_reward(completions, rows["answer"].to_list())
        operands = [json.loads(m)["a"] for m in rows["metadata"]]
        bonus = U.trl_operand_bonus(completions, rows["response_token_ids"].to_list(), operands)
        assert rows.height == 16 and None not in correct  # every training prompt has an answer
        assert len(set(bonus)) > 1  # values that differ from row to row
        for name, want in (("format", fmt), ("correct", correct), ("bonus", bonus)):
            assert rows[f"reward__{name}"].to_list() == pytest.approx(want, abs=0, rel=1e-7), name  # (float32)
        total = [0.5 * f + c + 2.0 * b for f, c, b in zip(fmt, correct, bonus, strict=True)]
        assert rows["reward"].to_list() == pytest.approx(total, abs=0, rel=1e-6)
