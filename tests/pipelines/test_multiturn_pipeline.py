"""A whole run with tool-use episodes: task with tool-using SFT traces, SFT, GRPO iterations whose
rollouts are calculator episodes, evaluation of greedy episodes; inspect and the report show the
episodes turn by turn."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys

import polars as pl
import pytest
import yaml
from conftest import MINI

from rlpipe.pipelines.preset import load_preset
from rlpipe.pipelines.report import run_table
from rlpipe.pipelines.runner import Pipeline

pytestmark = [pytest.mark.multiturn, pytest.mark.integration]

CALCULATOR = {"name": "tools", "kwargs": {"tools": ["calculator"]}, "max_turns": 2}


@pytest.fixture(scope="module")
def tools_run(tmp_path_factory):
    preset = copy.deepcopy(MINI) | {"name": "mini_tools"}
    preset["data"]["task"] |= {"ops": ["*"], "sft_tool_fraction": 0.5}
    preset["sft"]["max_steps"] = 20
    preset["rollout"] |= {"environment": CALCULATOR, "stop": ["</tool_call>"], "max_new_tokens": 24}
    preset["evaluate"] |= {"environment": CALCULATOR, "stop": ["</tool_call>"], "max_new_tokens": 24}
    root = tmp_path_factory.mktemp("tools_run")
    (root / "p.yaml").write_text(yaml.safe_dump(preset))
    run_dir = root / "runs" / "mini_tools"
    Pipeline(load_preset(root / "p.yaml"), run_dir).run()
    return run_dir


def test_a_tools_run_trains_on_episodes(tools_run):
    r = pl.read_parquet(tools_run / "iter_0001" / "rollouts" / "part-*.parquet")
    assert r["num_turns"].null_count() == 0 and r["response_mask"].null_count() == 0
    assert (r["response_mask"].list.len() == r["response_token_ids"].list.len()).all()
    adv = pl.read_parquet(tools_run / "iter_0001" / "advantages" / "part-*.parquet")
    joined = adv.join(r, on=["group_id", "sample_index"])
    for tokens, mask in zip(joined["token_advantages"], joined["response_mask"], strict=True):
        assert all(a == 0 for a, m in zip(tokens, mask, strict=True) if m == 0)  # nothing on the environment's
    table = run_table(tools_run)
    assert {"turns_mean", "tool_calls_mean", "eval_tool_calls_per_episode"} <= set(table.columns)


def test_inspect_shows_episodes_turn_by_turn(tools_run):
    env = {**os.environ, "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "rlpipe.pipelines.cli", "inspect", str(tools_run), "--samples", "16"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(r"│ model( \[(length|context)\])?: ", out.stdout) and "turns" in out.stdout
    page = (tools_run / "report" / "index.html").read_text()
    assert re.search(r"<td class='text'>model( \[(length|context)\])?: ", page)
