"""Scoring episodes: answers are checked in the last model turn, lengths count the model's tokens,
the environment's reward is a component, and user functions that name `turns` get them."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
from score_tables import rollouts_table, write_rollouts

from rlpipe.schemas.errors import UserError
from rlpipe.stages.score.config import ScoreConfig
from rlpipe.stages.score.run import run

pytestmark = pytest.mark.multiturn


def _turn(role, start, end, text, calls=()):
    return {"role": role, "start": start, "end": end, "text": text, "finish_reason": "stop" if role == "model" else None,
            "tool_calls": [{"name": "calculator", "arguments": '{"expression": "6*7"}', "error": None} for _ in calls],
            "tool_results": [], "reward": None}


def _episodes(tmp_path: Path) -> Path:
    # Row 0: calls the tool (4 tokens), gets 3 tokens back, answers '42' (2 tokens). Row 1: answers
    # '41' at once. Row 2: calls, gets the result, answers '42' but the episode text also holds '7'.
    call = "<tool_call>6*7</tool_call>"
    table = rollouts_table(["6*7="] * 4, [f"{call}\n42\n42", "41", f"{call}\n42\n42 7", "42"], ["42"] * 4,
                           lengths=[9, 2, 10, 2])
    table["response_mask"] = [[1] * 4 + [0] * 3 + [1] * 2, None, [1] * 4 + [0] * 3 + [1] * 3, None]
    table["num_turns"] = [2, 1, 2, 1]
    table["turns"] = [[_turn("model", 0, 4, call, [1]), _turn("environment", 4, 7, "\n42\n"), _turn("model", 7, 9, "42")],
                      [_turn("model", 0, 2, "41")],
                      [_turn("model", 0, 4, call, [1]), _turn("environment", 4, 7, "\n42\n"), _turn("model", 7, 10, "42 7")],
                      None]
    table["environment_reward"] = [0.5, None, 0.25, None]
    write_rollouts(tmp_path / "r", table)
    return tmp_path / "r"


def test_components_on_episodes(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # user_rewards.py
    components = [
        {"name": "correct", "type": "answer_match", "mode": "exact"},
        {"name": "numeric", "type": "answer_match", "mode": "numeric"},
        {"name": "env", "type": "environment", "weight": 2.0},
        {"name": "long", "type": "overlong", "max_length": 8, "buffer": 2},
        {"name": "calls", "type": "python", "function": "user_rewards:tool_calls_made", "weight": 0.0},
    ]
    run(ScoreConfig(rollouts=_episodes(tmp_path), output=tmp_path / "s", components=components))
    s = pl.read_parquet(tmp_path / "s" / "part-*.parquet").sort("group_id", "sample_index")
    assert s["reward__correct"].to_list() == [1.0, 0.0, 0.0, 1.0]  # row 2's last turn is '42 7'
    assert s["reward__numeric"].to_list() == [1.0, 0.0, 0.0, 1.0]  # its last number is 7
    assert s["reward__env"].to_list() == [0.5, 0.0, 0.25, 0.0]
    assert s["reward__long"].to_list() == [0.0, 0.0, -0.5, 0.0]  # 6, 2, 7, 2 sampled tokens (of 9, 2, 10, 2)
    assert s["reward__calls"].to_list() == [1.0, 0.0, 1.0, -1.0]
    assert s["response_length"].to_list() == [9, 2, 10, 2]  # the token positions, as in the rollouts
    assert s["sampled_tokens"].to_list() == [6, 2, 7, 2]  # the mask's ones: what the model sampled


def test_an_environment_component_on_single_turn_rollouts_is_refused(tmp_path):
    table = rollouts_table(["q"] * 2, ["a", "b"], ["a", "a"])
    write_rollouts(tmp_path / "r", table)
    with pytest.raises(UserError, match="not episodes .*rollout.environment"):
        run(ScoreConfig(rollouts=tmp_path / "r", output=tmp_path / "s",
                        components=[{"name": "env", "type": "environment"}]))
