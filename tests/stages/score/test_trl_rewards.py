"""Reward functions written for TRL's GRPOTrainer run unchanged (`style: auto` finds them by their
`completions` parameter): called with every argument by keyword, each dataset column (the answer,
each metadata key) as its own keyword, messages where the rollout used the chat template; a None
is a row the function leaves out (nothing added to the total, left out of the component's mean).
The scores equal calling the function directly on the same rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from rlpipe.schemas import ROLLOUTS, read_manifest, read_table_artifact, write_table_artifact
from rlpipe.schemas.config_files import parse_config
from rlpipe.stages.score.config import ScoreConfig
from rlpipe.stages.score.run import run
from rlpipe.stages.score.scorers import ScoreError

pytestmark = pytest.mark.hf

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _user_module_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # user_rewards.py


def _rollouts(path: Path, chat: bool) -> Path:
    """12 rows (6 groups of 2) in shards of 4 rows; answers on even groups only, `level` metadata
    on groups 0-3."""
    from score_tables import rollouts_table

    responses = ["4", " 4 ", "five", "6", "7", "x", "8", "8", "9", " ", "10", "-3"]
    answers = [str(4 + g) if g % 2 == 0 else None for g in range(6) for _ in range(2)]
    metadata = [json.dumps({"level": g}) if g < 4 else None for g in range(6) for _ in range(2)]
    table = rollouts_table([f"What is {g}+4?" for g in range(6) for _ in range(2)], responses, answers,
                           metadata=metadata)
    write_table_artifact(path, ROLLOUTS, table, stage="test", shard_by="group_id", rows_per_shard=4,
                         extra={"sampled_by": {"policy_version": 0, "staleness": 0, "chat_template": chat}})
    return path


COMPONENTS = [
    {"name": "format", "type": "python", "function": "user_rewards:trl_format_reward", "weight": 0.5},
    {"name": "correct", "type": "python", "function": "user_rewards:trl_accuracy_reward", "batch_size": 3},
    {"name": "level", "type": "python", "function": "user_rewards:trl_level_bonus"},
]


@pytest.mark.parametrize("chat", [False, True], ids=["standard", "conversational"])
def test_trl_reward_functions_score_as_a_direct_call_would(tmp_path, chat):
    import user_rewards as U  # (importable once the fixture put this folder on sys.path)

    rollouts = _rollouts(tmp_path / "r", chat)
    run(parse_config(ScoreConfig, {"rollouts": rollouts, "output": tmp_path / "s", "components": COMPONENTS}))
    got = read_table_artifact(tmp_path / "s").to_pylist()
    rows = read_table_artifact(rollouts).to_pylist()
    wrap = (lambda t, role: [{"role": role, "content": t}]) if chat else (lambda t, role: t)
    completions = [wrap(r["response"], "assistant") for r in rows]
    prompts = [wrap(r["prompt"], "user") for r in rows]
    levels = [(json.loads(r["metadata"]) if r["metadata"] else {}).get("level") for r in rows]
    want = {"format": U.trl_format_reward(completions),
            "correct": U.trl_accuracy_reward(completions, [r["answer"] for r in rows]),
            "level": U.trl_level_bonus(prompts, completions, [r["response_token_ids"] for r in rows], levels)}
    for name, values in want.items():
        column = [g[f"reward__{name}"] for g in got]
        assert [math.isnan(v) for v in column] == [v is None for v in values], name
        assert [v for v in column if not math.isnan(v)] == pytest.approx([v for v in values if v is not None],
                                                                          abs=0, rel=1e-7), name  # (float32 column)
    # the total: sum of weight x value over the components that gave one (TRL's nansum)
    for g, f, c, lv in zip(got, want["format"], want["correct"], want["level"], strict=True):
        assert g["reward"] == pytest.approx(0.5 * f + (c or 0.0) + (lv or 0.0), abs=0, rel=1e-6)
    # a component's mean leaves its None rows out
    correct = [v for v in want["correct"] if v is not None]
    assert read_manifest(tmp_path / "s").extra["reward__correct_mean"] == pytest.approx(np.mean(correct))


def test_a_trl_function_is_given_messages_only_where_the_rollout_used_the_chat_template(tmp_path):
    comp = [{"name": "sees", "type": "python", "function": "user_rewards:trl_sees"}]
    for chat in (False, True):
        run(parse_config(ScoreConfig, {"rollouts": _rollouts(tmp_path / f"r{chat}", chat),
                                       "output": tmp_path / f"s{chat}", "components": comp}))
        assert {r["reward__sees"] for r in read_table_artifact(tmp_path / f"s{chat}").to_pylist()} == {float(chat)}


def test_style_settles_a_signature_that_could_be_either(tmp_path):
    """`length_bonus(prompts, responses, answers)` called the TRL way has no `responses`: an error
    naming the function, not a silent wrong call."""
    rollouts = _rollouts(tmp_path / "r", False)
    comp = {"name": "len", "type": "python", "function": "user_rewards:length_bonus", "style": "trl"}
    with pytest.raises(ScoreError, match="user_rewards:length_bonus raised TypeError"):
        run(parse_config(ScoreConfig, {"rollouts": rollouts, "output": tmp_path / "s", "components": [comp]}))
    comp["style"] = "rlpipe"
    run(parse_config(ScoreConfig, {"rollouts": rollouts, "output": tmp_path / "s", "components": [comp]}))


def test_a_metadata_key_given_twice_is_refused_naming_it(tmp_path):
    rollouts = _rollouts(tmp_path / "r", False)
    comp = {"name": "lv", "type": "python", "function": "user_rewards:trl_level_bonus", "kwargs": {"level": 1}}
    with pytest.raises(ScoreError, match=r"metadata key\(s\) \['level'\] would be given twice"):
        run(parse_config(ScoreConfig, {"rollouts": rollouts, "output": tmp_path / "s", "components": [comp]}))
