"""Prompt metadata reaches user reward functions: row by row, across shards and batches."""

import json
from pathlib import Path

import pytest

from rlpipe.schemas import read_table_artifact
from rlpipe.schemas.config_files import parse_config
from rlpipe.stages.score.config import ScoreConfig
from rlpipe.stages.score.run import run
from rlpipe.stages.score.scorers import ScoreError, accepts_metadata

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _user_module_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # user_rewards.py


def _config(rollouts, out, components):
    return parse_config(ScoreConfig, {"rollouts": str(rollouts), "output": str(out), "components": components})


@pytest.fixture
def metadata_rollouts(tmp_path):
    """18 rows (9 groups of 2) in shards of 4 groups; group g's metadata holds points 10*g + 1 and
    its prompt text, except every third group, which has none."""
    from score_tables import rollouts_table, write_rollouts

    prompts = [f"Q: {g}+{g}= A:" for g in range(9) for _ in range(2)]
    metadata = [None if g % 3 == 2 else json.dumps({"prompt": f"Q: {g}+{g}= A:", "points": 10.0 * g + 1})
                for g in range(9) for _ in range(2)]
    table = rollouts_table(prompts, [" x"] * 18, [None] * 18, metadata=metadata)
    write_rollouts(tmp_path / "r", table, rows_per_shard=8)
    return tmp_path / "r"


def test_user_function_gets_each_rows_metadata(metadata_rollouts, tmp_path):
    # batch_size 3 cuts batches across groups (and shards end every 8 rows): a value that followed
    # the wrong row would show as another group's points, or -100.
    comps = [{"name": "pts", "type": "python", "function": "user_rewards:metadata_points", "batch_size": 3},
             {"name": "keys", "type": "python", "function": "user_rewards:metadata_through_kwargs"},
             {"name": "chars", "type": "python", "function": "user_rewards:length_bonus"}]  # no metadata arg
    run(_config(metadata_rollouts, tmp_path / "s", comps))
    scores = read_table_artifact(tmp_path / "s").to_pylist()
    assert len(scores) == 18
    for row in scores:
        g = row["group_id"]
        assert row["reward__pts"] == (0.0 if g % 3 == 2 else 10.0 * g + 1)
        assert row["reward__keys"] == (0 if g % 3 == 2 else 2)
        assert row["reward__chars"] == 2.0  # len(" x"): the old three-argument function still works


def test_metadata_in_kwargs_is_refused_when_the_function_takes_it(metadata_rollouts, tmp_path):
    comp = {"name": "pts", "type": "python", "function": "user_rewards:metadata_points", "kwargs": {"metadata": 1}}
    with pytest.raises(ScoreError, match="kwargs may not set it too"):
        run(_config(metadata_rollouts, tmp_path / "s", [comp]))


def test_accepts_metadata_reads_the_signature():
    def old(prompts, responses, answers, scale=1.0): ...
    def named(prompts, responses, answers, metadata): ...
    def keyword_only(prompts, responses, answers, *, metadata=None): ...
    def var_kw(prompts, responses, answers, **kw): ...
    def positional_only(prompts, responses, answers, metadata, /): ...

    assert [accepts_metadata(f) for f in (old, named, keyword_only, var_kw, positional_only)] == [
        False, True, True, True, False]


def test_bad_metadata_json_names_shard_and_row(tmp_path):
    from score_tables import rollouts_table, write_rollouts

    from rlpipe.schemas import ArtifactError

    write_rollouts(tmp_path / "r", rollouts_table(["q"] * 2, ["a", "b"], [None] * 2, metadata=['{"a": 1}', "[1]"]))
    with pytest.raises(ArtifactError, match=r"part-00000.parquet, row 1: column 'metadata' holds a JSON list"):
        run(_config(tmp_path / "r", tmp_path / "s", [{"name": "f", "type": "regex_format", "pattern": "x"}]))
