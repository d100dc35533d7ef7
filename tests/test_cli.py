"""The `rlpipe` command line: schema, validate, inspect (artifact, checkpoint, run), stage."""

import shutil
import subprocess
import sys
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from rlpipe.pipelines.cli import app
from rlpipe.pipelines.inspect import run_summary, safetensors_params, table_stats
from rlpipe.schemas import (
    METRICS,
    ROLLOUTS,
    SCHEMAS,
    SCORES,
    commit_directory,
    scan_artifact,
    write_table_artifact,
)
from rlpipe.schemas.examples import example_table
from rlpipe.schemas.runs import iteration_dir_name

runner = CliRunner()
FORMAT = SCORES.families[0].column("format")


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "400"})


def _scores(k: int, rewards: list[float], finish: list[str]) -> pa.Table:
    t = example_table(SCORES, len(rewards), iteration=k, seed=k, extra=(FORMAT,))
    t = t.set_column(t.column_names.index("reward"), SCORES.arrow().field("reward"),
                     pa.array(rewards, pa.float32()))
    t = t.set_column(t.column_names.index("reward__format"), t.schema.field("reward__format"),
                     pa.array([r / 2 for r in rewards], pa.float32()))
    return t.set_column(t.column_names.index("finish_reason"), t.schema.field("finish_reason"), pa.array(finish))


def _metrics(k: int, losses: list[float]) -> pa.Table:
    n = len(losses)
    return pa.table({"run": ["r"] * 2 * n, "iteration": [k] * 2 * n, "stage": ["optimize"] * 2 * n,
                     "step": list(range(n)) * 2, "name": ["policy_loss"] * n + ["clip_fraction"] * n,
                     "value": losses + [0.1 * k] * n}, schema=METRICS.arrow())


@pytest.fixture
def run_dir(tmp_path):
    """runs/demo: iterations 0-1 complete, 2 with rollouts only, 3 with an unfinished rollouts."""
    run = tmp_path / "demo"
    for k in range(3):
        it = run / iteration_dir_name(k)
        write_table_artifact(it / "rollouts", ROLLOUTS, example_table(ROLLOUTS, 8, iteration=k, seed=k),
                             stage="rollout", rows_per_shard=4, shard_by="group_id")
        if k < 2:
            write_table_artifact(it / "scores", SCORES, _scores(k, [k, 1.0, 0.0, 1.0], ["stop", "length", "stop", "stop"]),
                                 stage="score", extra_columns=(FORMAT,))
            write_table_artifact(it / "metrics", METRICS, _metrics(k, [1.0, 0.5 - k]), stage="optimize")
    # an unfinished artifact: a shard, no manifest (writers stage theirs; this is a foreign copy)
    (run / "iter_0003" / "rollouts").mkdir(parents=True)
    pq.write_table(example_table(ROLLOUTS, 4, iteration=3), run / "iter_0003" / "rollouts" / "part-00000.parquet")
    write_table_artifact(run / "data" / "prompts_train", SCHEMAS["prompts"], example_table(SCHEMAS["prompts"], 5),
                         stage="data")
    return run


def test_schema_lists_and_describes():
    r = invoke("schema")
    assert r.exit_code == 0
    for name, s in SCHEMAS.items():
        assert name in r.output and s.doc in r.output
    r = invoke("schema", "rollouts")
    assert r.exit_code == 0
    assert "response_logprobs" in r.output and "list<item: float>" in r.output
    assert "same length as response_token_ids" in r.output
    r = invoke("schema", "scores")
    assert "reward__<name>" in r.output
    r = invoke("schema", "rollout")
    assert r.exit_code == 2
    assert "unknown schema 'rollout'; known schemas: prompts, preferences, rollouts" in r.output


def test_validate_ok_and_invalid(run_dir):
    art = run_dir / "iter_0000" / "rollouts"
    r = invoke("validate", art)
    assert r.exit_code == 0
    assert r.output.strip().startswith(f"OK {art}: table rollouts v{ROLLOUTS.version}, 8 rows in 2 shard(s), stage rollout")
    assert invoke("validate", art, "--schema", "scores").exit_code == 1
    # a shard replaced by one missing a column: exit 1, the file and the column named
    shard = art / "part-00001.parquet"
    pq.write_table(example_table(ROLLOUTS, 4).drop_columns(["seed"]), shard)
    r = invoke("validate", art)
    assert r.exit_code == 1
    assert f"INVALID {art}" in r.output
    assert f"{shard}: content differs from the manifest's xxh3_128" in r.output
    assert f"{shard}: does not match schema 'rollouts'" in r.output and "missing column 'seed' (int64)" in r.output
    r = invoke("validate", run_dir / "iter_0003" / "rollouts")
    assert r.exit_code == 1 and "has no _manifest.json" in r.output


def test_table_stats_values(run_dir):
    stats = table_stats(scan_artifact(run_dir / "iter_0001" / "scores"))
    assert stats["rows"] == 4
    assert stats["stats"]["reward"]["mean"] == pytest.approx(0.75)
    assert stats["stats"]["reward"]["min"] == 0.0 and stats["stats"]["reward"]["max"] == 1.0
    assert stats["components"] == {"reward__format": pytest.approx(0.375)}
    assert stats["finish_reasons"] == {"length": 0.25, "stop": 0.75}
    rollouts = example_table(ROLLOUTS, 8, iteration=0, seed=0)
    lengths = [len(x) for x in rollouts.column("response_token_ids").to_pylist()]
    stats = table_stats(scan_artifact(run_dir / "iter_0000" / "rollouts"))
    assert stats["stats"]["response length"]["mean"] == pytest.approx(sum(lengths) / 8)
    assert stats["stats"]["response length"]["max"] == max(lengths)


def test_inspect_table_artifact(run_dir):
    r = invoke("inspect", run_dir / "iter_0001" / "scores", "--rows", "2")
    assert r.exit_code == 0, r.output
    assert "scores v2" in r.output and "4 in 1 shard(s)" in r.output and "stage" in r.output
    assert "0.75" in r.output  # reward mean
    assert "format" in r.output and "0.375" in r.output  # component mean
    assert "finish reasons: length 25.0%, stop 75.0%" in r.output
    assert "first 2 row(s)" in r.output
    r = invoke("inspect", run_dir / "iter_0000" / "rollouts")
    assert r.exit_code == 0 and "response length" in r.output and "first 3 row(s)" in r.output
    r = invoke("inspect", run_dir / "iter_0000" / "metrics")
    assert r.exit_code == 0 and "policy_loss" in r.output and "clip_fraction" in r.output


def test_inspect_truncates_long_values(tmp_path):
    t = example_table(ROLLOUTS, 4, max_len=40)
    t = t.set_column(t.column_names.index("response"), t.schema.field("response"), pa.array(["x" * 500] * 4))
    write_table_artifact(tmp_path / "r", ROLLOUTS, t, stage="rollout")
    r = invoke("inspect", tmp_path / "r", "-n", "1")
    assert r.exit_code == 0
    assert "x" * 48 + "... (500 chars)" in r.output and "x" * 49 not in r.output
    n = len(t.column("response_token_ids")[0].as_py())
    assert (f"... ({n} items)]" in r.output) == (n > 6)


def test_run_summary_values(run_dir):
    df = run_summary(run_dir, ["policy_loss"])
    assert df["iteration"].to_list() == [1, 2, 3, 4]  # shown numbering: iteration n is iter_{n-1:04d}
    assert df["rollouts"].to_list() == [8, 8, 8, None]
    assert df["groups"].to_list() == [2, 2, 2, None]
    assert df["reward_mean"].to_list() == [pytest.approx(0.5), pytest.approx(0.75), None, None]
    assert df["policy_loss"].to_list() == [0.5, -0.5, None, None]  # mean over the optimizer steps (one)
    assert df["clip_fraction"].to_list() == [0.0, pytest.approx(0.1), None, None]
    assert df["artifacts"].to_list()[2:] == ["rollouts", "rollouts!"]
    expected_trunc = [(example_table(ROLLOUTS, 8, iteration=k, seed=k).column("finish_reason").to_pylist().count("length")) / 8
                      for k in range(3)]
    assert df["truncated_fraction"].to_list()[:3] == pytest.approx(expected_trunc)


def test_inspect_run_dir(run_dir):
    r = invoke("inspect", run_dir)
    assert r.exit_code == 0, r.output
    assert "4 iteration(s)" in r.output and "clip" in r.output and "rollouts!" in r.output
    assert "data/prompts_train" in r.output  # artifacts outside the iterations are listed
    r = invoke("inspect", run_dir, "--metric", "nope")
    assert r.exit_code == 1 and "metric(s) ['nope'] not logged" in r.output
    r = invoke("inspect", run_dir / "iter_0003" / "rollouts")
    assert r.exit_code == 1 and "no _manifest.json" in r.output
    r = invoke("inspect", run_dir / "missing")
    assert r.exit_code == 1 and "does not exist" in r.output


def test_run_summary_wall_time_counts_each_stage_once(tmp_path):
    it = tmp_path / "iter_0000"
    write_table_artifact(it / "rollouts", ROLLOUTS, example_table(ROLLOUTS, 4), stage="rollout", wall_time_s=2.0)
    write_table_artifact(it / "metrics", METRICS, _metrics(0, [1.0]), stage="optimize", wall_time_s=3.0)
    (it / "policy").mkdir()
    (it / "policy" / "config.json").write_text("{}")
    commit_directory(it / "policy", stage="optimize", wall_time_s=5.0)
    assert run_summary(tmp_path)["wall_s"].to_list() == [7.0]


def test_inspect_run_with_only_rollouts(tmp_path):
    write_table_artifact(tmp_path / "iter_0000" / "rollouts", ROLLOUTS, example_table(ROLLOUTS, 4), stage="rollout")
    df = run_summary(tmp_path)
    # (example rows are episodes on two rows of three: turns and tool calls are summarised too)
    assert df.columns == ["iteration", "artifacts", "wall_s", "rollouts", "groups", "response_length", "truncated_fraction",
                          "turns_mean", "tool_calls_mean"]
    assert invoke("inspect", tmp_path).exit_code == 0


def test_inspect_checkpoint(tmp_path, tiny_policy_dir):
    from rlpipe.stages.common.tiny import load_checkpoint

    ckpt = shutil.copytree(tiny_policy_dir, tmp_path / "policy")
    commit_directory(ckpt, stage="optimize")
    model, _ = load_checkpoint(ckpt)
    assert safetensors_params(ckpt) == model.num_parameters()
    r = invoke("inspect", ckpt)
    assert r.exit_code == 0, r.output
    assert "checkpoint" in r.output and "LlamaForCausalLM" in r.output
    assert f"{model.num_parameters():,}" in r.output


@pytest.fixture
def fake_stage(monkeypatch, tmp_path):
    """A stage registered as 'fake' (config + run modules in sys.modules) that records its configs."""
    from pathlib import Path as P
    from typing import Annotated

    from rlpipe.schemas import Manifest
    from rlpipe.schemas.config import Output, StageConfig
    from rlpipe.stages import STAGES, Stage

    class FakeConfig(StageConfig):
        """A fake stage."""

        output: Annotated[P, Output("metrics")]
        """Where it writes."""
        seed: int = 0
        """A knob."""

    calls = []

    def run(config, *, force=False):
        calls.append((config, force))
        return Manifest(kind="checkpoint", stage="fake", content_hash="0" * 64, files=[])

    for name, attrs in (("config", {"FakeConfig": FakeConfig}), ("run", {"run": run})):
        mod = types.ModuleType(f"rlpipe.stages.fake.{name}")
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(STAGES, "fake", Stage("fake", "FakeConfig", "a fake stage"))
    return calls


def test_stage_dispatch(fake_stage, tmp_path):
    r = invoke("stage", "fake", f"output={tmp_path}", "seed=1", "--force")
    assert r.exit_code == 0, r.output
    (config, force), = fake_stage
    assert config.seed == 1 and force and f"fake: wrote {tmp_path}" in r.output
    r = invoke("stage", "fake", "sed=1")
    assert r.exit_code == 2 and "unknown key 'sed'" in r.output
    r = invoke("stage", "nope")
    assert r.exit_code == 2 and "unknown stage 'nope'; stages: task, base_model" in r.output and "fake" in r.output
    r = invoke("stage", "--help")
    assert r.exit_code == 0 and "reference " in r.output and "reference log-probs and critic values" in r.output


def test_installed_entry_point_and_light_startup():
    script = Path(sys.executable).parent / "rlpipe"
    out = subprocess.run([str(script), "schema", "prompts"], capture_output=True, text=True, check=True,
                         env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert "prompt_id" in out.stdout
    code = ("import sys, rlpipe.pipelines.cli; heavy = [m for m in ('torch', 'transformers', 'polars', "
            "'pyarrow') if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)
