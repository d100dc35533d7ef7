"""The score stage end to end on small rollouts artifacts written directly."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from rlpipe.schemas import exists, read_manifest, read_table_artifact, validate_artifact
from rlpipe.schemas.config_files import ConfigError, parse_config, union_tags
from rlpipe.schemas.staging import staging_path
from rlpipe.stages.common.models import load_model
from rlpipe.stages.reward_model.modeling import score_texts
from rlpipe.stages.score import run as score_run
from rlpipe.stages.score import scorers
from rlpipe.stages.score.config import Component, ScoreConfig
from rlpipe.stages.score.run import run
from rlpipe.stages.score.scorers import ScoreError, register

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _user_module_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # user_rewards.py


def _components(rm_dir):
    return [
        {"name": "correct", "type": "answer_match", "mode": "numeric", "weight": 1.0},
        {"name": "format", "type": "regex_format", "pattern": r"^ \d+$", "weight": 0.5},
        {"name": "overlong", "type": "overlong", "max_length": 8, "buffer": 4, "weight": 1.0},
        {"name": "chars", "type": "python", "function": "user_rewards:length_bonus", "kwargs": {"scale": 0.1},
         "batch_size": 4, "weight": -1.0},
        {"name": "rm", "type": "reward_model", "checkpoint": str(rm_dir), "batch_size": 5, "weight": 0.3},
    ]


def _config(rollouts, out, components, **kw):
    return parse_config(ScoreConfig, {"rollouts": str(rollouts), "output": str(out), "components": components, **kw})


def test_scores_every_component(arith_rollouts, tiny_reward_dir, tmp_path):
    manifest = run(_config(arith_rollouts, tmp_path / "scores", _components(tiny_reward_dir)))
    assert validate_artifact(tmp_path / "scores") == []
    assert manifest.shard_names == read_manifest(arith_rollouts).shard_names  # one per input shard
    s = read_table_artifact(tmp_path / "scores").to_pydict()
    r = read_table_artifact(arith_rollouts).to_pydict()
    for k in ("run", "iteration", "prompt_id", "group_id", "sample_index", "finish_reason"):
        assert s[k] == r[k]
    lengths = [len(t) for t in r["response_token_ids"]]
    assert s["response_length"] == lengths
    assert s["reward__correct"] == [0.0 if i % 3 == 0 else 1.0 for i in range(24)]
    assert s["reward__format"] == [1.0] * 24
    # DAPO overlong, L_max 8, L_buf 4, written out: 0 up to 4 tokens, (4 - L) / 4 up to 8, then -1
    by_length = {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0, 5: -0.25, 6: -0.5, 7: -0.75, 8: -1.0, 9: -1.0}
    assert s["reward__overlong"] == [by_length[n] for n in lengths]
    assert sorted(set(s["reward__overlong"])) == [-1.0, -0.75, -0.5, -0.25, 0.0]  # L = 1..9: all regions
    np.testing.assert_allclose(s["reward__chars"], [0.1 * len(x) for x in r["response"]], rtol=1e-6)
    model, tok = load_model(tiny_reward_dir, "reward")
    rm = score_texts(model, tok, r["prompt"], r["response"], max_length=1024, batch_size=64).numpy()
    np.testing.assert_allclose(s["reward__rm"], rm, atol=1e-5)
    expected = (np.array(s["reward__correct"]) + 0.5 * np.array(s["reward__format"]) + np.array(s["reward__overlong"])
                - np.array(s["reward__chars"]) + 0.3 * np.array(s["reward__rm"]))
    np.testing.assert_allclose(s["reward"], expected, atol=1e-5)
    assert manifest.extra["reward__correct_mean"] == pytest.approx(16 / 24)
    assert set(manifest.inputs) == {"rollouts", "reward_model:rm"}


def test_scoring_twice_is_identical_and_cached(arith_rollouts, tiny_reward_dir, tmp_path, monkeypatch):
    cfg = _config(arith_rollouts, tmp_path / "scores", _components(tiny_reward_dir))
    first = run(cfg)
    second = run(cfg, force=True)
    assert second.content_hash == first.content_hash
    other = run(_config(arith_rollouts, tmp_path / "again", _components(tiny_reward_dir)))
    assert other.content_hash == first.content_hash
    monkeypatch.setattr(score_run, "build_scorer", lambda c: pytest.fail("scored on a cache hit"))
    assert run(cfg).content_hash == first.content_hash


def test_workers_in_process_match_one(arith_rollouts, tiny_reward_dir, tmp_path):
    one = run(_config(arith_rollouts, tmp_path / "one", _components(tiny_reward_dir)))
    out = tmp_path / "two"
    w1 = run(_config(arith_rollouts, out, _components(tiny_reward_dir), worker_index=1, worker_count=2))
    assert w1.extra["partial"] and not exists(out)
    assert w1.shard_names == ["part-00001.parquet", "part-00003.parquet"]
    w0 = run(_config(arith_rollouts, out, _components(tiny_reward_dir), worker_index=0, worker_count=2))
    assert exists(out) and w0.content_hash == one.content_hash
    assert not list(out.glob(".worker-*"))  # markers removed after the commit


@pytest.mark.slow
def test_two_processes_match_one(arith_rollouts, tiny_reward_dir, tmp_path):
    one = run(_config(arith_rollouts, tmp_path / "one", _components(tiny_reward_dir)))
    cfg_file = tmp_path / "score.yaml"
    cfg_file.write_text(yaml.safe_dump({"rollouts": str(arith_rollouts), "output": str(tmp_path / "two"),
                                        "components": _components(tiny_reward_dir)}))
    env = {**os.environ, "PYTHONPATH": str(HERE), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "rlpipe.stages.score", "-c", str(cfg_file),
                               "worker_count=2", f"worker_index={i}"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    two = read_manifest(tmp_path / "two")
    assert two.content_hash == one.content_hash
    assert read_table_artifact(tmp_path / "two").equals(read_table_artifact(tmp_path / "one"))
    assert validate_artifact(tmp_path / "two") == []


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("user_rewards:raises", r"'bad' \(python\): .*part-00000.parquet, rows 0..3: user_rewards:raises raised ZeroDivisionError: boom"),
        ("user_rewards:returns_nan_at_3", r"'bad' \(python\): .*part-00000.parquet, row 3 \(group_id=1, sample_index=1\): .* returned nan"),
        ("user_rewards:returns_too_few", r"part-00000.parquet, rows 0..3: user_rewards:returns_too_few returned 3 values for 4 rows"),
        ("user_rewards:missing", r"'bad' \(python\): cannot import 'user_rewards:missing'"),
    ],
)
def test_bad_user_function_writes_nothing(arith_rollouts, tmp_path, function, message):
    out = tmp_path / "scores"
    comps = [{"name": "fmt", "type": "regex_format", "pattern": "."},
             {"name": "bad", "type": "python", "function": function, "batch_size": 4}]
    with pytest.raises(ScoreError, match=message):
        run(_config(arith_rollouts, out, comps))
    assert not exists(out)


def test_a_failed_rerun_leaves_the_old_artifact_whole(arith_rollouts, tmp_path):
    out = tmp_path / "scores"
    ok = [{"name": "fmt", "type": "regex_format", "pattern": "."}]
    first = run(_config(arith_rollouts, out, ok))
    # row 20 (the only 'Q: 6+0= A:') is in the last of 4 shards: shards 0-2 get written first
    bad = ok + [{"name": "bad", "type": "python", "function": "user_rewards:nan_for_prompt",
                 "kwargs": {"prompt": "Q: 6+0= A:"}}]
    with pytest.raises(ScoreError, match=r"part-00003.parquet, row 2 \(group_id=10, sample_index=0\)"):
        run(_config(arith_rollouts, out, bad))
    # the earlier complete artifact is whole; the failed run's shards stayed in its staging
    assert read_manifest(out).content_hash == first.content_hash and validate_artifact(out) == []
    staging = staging_path(out)
    assert sorted(p.name for p in staging.glob("part-*")) == [f"part-0000{i}.parquet" for i in range(3)]
    assert run(_config(arith_rollouts, out, ok)) == first  # still a cache hit
    manifest = run(_config(arith_rollouts, out, ok), force=True)
    assert not staging.exists()
    assert validate_artifact(out) == []
    assert manifest.content_hash == run(_config(arith_rollouts, tmp_path / "fresh", ok)).content_hash


def test_reward_model_checkpoint_errors(arith_rollouts, tiny_policy_dir, tmp_path):
    def rm(path):
        return [{"name": "rm", "type": "reward_model", "checkpoint": str(path)}]

    with pytest.raises(ScoreError, match=r"'rm' \(reward_model\): reward model checkpoint .*nope does not exist"):
        run(_config(arith_rollouts, tmp_path / "s", rm(tmp_path / "nope")))
    with pytest.raises(ScoreError, match=r"LlamaForCausalLM.*not a sequence-classification reward model"):
        run(_config(arith_rollouts, tmp_path / "s", rm(tiny_policy_dir)))


def test_missing_reference_answer(tmp_path):
    from score_tables import rollouts_table, write_rollouts

    write_rollouts(tmp_path / "r", rollouts_table(["Q: 1+1= A:"] * 2, [" 2", " 2"], ["2", None]))
    comp = {"name": "ok", "type": "answer_match"}
    with pytest.raises(ScoreError, match=r"row 1 \(group_id=0, sample_index=1\): the rollout has no reference answer"):
        run(_config(tmp_path / "r", tmp_path / "s", [comp]))
    run(_config(tmp_path / "r", tmp_path / "s", [{**comp, "missing_answer": "zero"}]))
    assert read_table_artifact(tmp_path / "s").column("reward").to_pylist() == [1.0, 0.0]


def test_empty_rollouts(tmp_path):
    from score_tables import rollouts_table, write_rollouts

    write_rollouts(tmp_path / "r", rollouts_table([], [], []))
    m = run(_config(tmp_path / "r", tmp_path / "s", [{"name": "f", "type": "regex_format", "pattern": "x"}]))
    assert m.rows == 0 and validate_artifact(tmp_path / "s") == []


def test_config_errors():
    base = {"rollouts": "r", "output": "s"}
    bad = [
        ([{"name": "a", "type": "regex_format", "pattern": "x"}] * 2, "component names must be unique"),
        ([{"name": "a", "type": "regex_format", "pattern": "("}], "not a valid regex"),
        ([{"name": "a", "type": "answer_match", "pattern": r"\d+"}], "exactly one capture group"),
        ([{"name": "a", "type": "overlong", "max_length": 4, "buffer": 8}], "must not exceed max_length"),
        ([{"name": "a b", "type": "overlong", "max_length": 4, "buffer": 2}], "key 'components.0.name'"),
        ([{"name": "a", "type": "python", "function": "no_colon"}], "key 'components.0.function'"),
        ([{"name": "a", "type": "nope"}], "does not match any of the expected tags"),
    ]
    for comps, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            parse_config(ScoreConfig, {**base, "components": comps})
    with pytest.raises(ConfigError, match="needs a worker_index"):
        parse_config(ScoreConfig, {**base, "components": [{"name": "a", "type": "regex_format", "pattern": "x"}],
                                   "worker_count": 2})


def test_registry_rejects_a_second_registration():
    with pytest.raises(ValueError, match="'overlong' is already registered"):
        register("overlong")(lambda c: None)
    assert set(scorers.SCORERS) == {"reward_model", "answer_match", "regex_format", "overlong", "python", "environment"}


def test_config_union_and_registry_name_the_same_components():
    # One list of names: every `type` tag of the component union has a scorer, and no scorer lacks a config.
    assert set(union_tags(Component, "type")) == set(scorers.SCORERS)
