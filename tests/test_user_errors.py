"""One test per kind of user mistake, each through the real command line (`rlpipe.pipelines.cli`
app, a few as a subprocess of the installed `rlpipe` script): exit code 2, one `error:` paragraph
naming the file, key or row and what to do, and no traceback.

The stage-level catalogue of corrupted artifacts (bit flips, edited manifests) is
tests/reliability/test_malformed_inputs.py; these are the mistakes a new user makes with their own
model, data and presets.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import yaml
from score_tables import rollouts_table, write_rollouts
from typer.testing import CliRunner

from rlpipe.pipelines.cli import app
from rlpipe.schemas import PROMPTS, write_table_artifact

pytestmark = pytest.mark.user_errors

RLPIPE = Path(sys.executable).parent / "rlpipe"
PROMPT_ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((1, 1), (2, 2), (2, 3), (3, 3))]


def assert_user_error(output: str, *names: str) -> str:
    """The output ends in exactly one `error:` paragraph that contains every text of `names`,
    and nothing in it is a traceback; returns the paragraph."""
    assert "Traceback" not in output, output
    assert output.count("error:") == 1, output
    message = output[output.index("error:"):].strip()
    assert "\n\n" not in message, message  # one paragraph
    for name in names:
        assert name in message, f"{name!r} not in the message:\n{message}"
    return message


def cli(*args) -> tuple[int, str]:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


def script(*args, cwd: Path) -> tuple[int, str]:
    """The installed `rlpipe` script as a process: what a user sees on the terminal."""
    done = subprocess.run([str(RLPIPE), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


@pytest.fixture
def data(tmp_path) -> Path:
    """A prompts file and its imported artifact."""
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPT_ROWS))
    code, out = cli("data", "import", tmp_path / "p.jsonl", tmp_path / "prompts")
    assert code == 0, out
    return tmp_path


def preset(where: Path, checkpoint: Path, **sections) -> Path:
    """A preset on the user's own model and prompts (rewrites `sections` of the default one)."""
    spec = {"name": "mine", "iterations": 1, "prompts_per_iteration": 2,
            "data": {"prompts": str(where / "prompts")}, "model": {"base": str(checkpoint)},
            "rollout": {"group_size": 2, "max_new_tokens": 2}, "evaluate": {"max_new_tokens": 2},
            "score": {"components": [{"name": "correct", "type": "answer_match"}]}, **sections}
    path = where / "mine.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_missing_model_path(data, tiny_policy_dir):
    code, out = cli("run", preset(data, data / "no_such_model"), "--local", "--run-dir", data / "run")
    assert code == 2
    assert_user_error(out, "model.base", f"{data}/no_such_model does not exist", "Hugging Face checkpoint",
                      "model.base=PATH")
    assert not (data / "run" / "models").exists()  # checked before any stage ran


def test_missing_input_artifact(data, tiny_policy_dir):
    code, out = cli("run", preset(data, tiny_policy_dir, data={"prompts": str(data / "no_prompts")}),
                    "--local", "--run-dir", data / "run")
    assert code == 2
    assert_user_error(out, "data.prompts", f"{data}/no_prompts does not exist", "rlpipe data import")
    code, out = cli("stage", "score", f"rollouts={data}/no_rollouts", f"output={data}/scores",
                    "components=[{name: c, type: answer_match}]")
    assert code == 2
    assert_user_error(out, "rollouts", f"{data}/no_rollouts does not exist", "write it first")


def test_wrong_artifact_kind(data):
    write_rollouts(data / "rollouts", rollouts_table(["1+1="] * 2, ["2", "3"], ["2"] * 2))
    code, out = cli("stage", "score", f"rollouts={data}/rollouts", f"output={data}/scores",
                    "components=[{name: c, type: answer_match}]")
    assert code == 0, out
    # a scores artifact where rollouts are expected
    code, out = cli("stage", "score", f"rollouts={data}/scores", f"output={data}/rescored",
                    "components=[{name: c, type: answer_match}]")
    assert code == 2
    assert_user_error(out, "rollouts", f"{data}/scores holds 'scores' rows, but a 'rollouts' artifact is expected")
    assert not (data / "rescored").exists()


def test_truncated_safetensors(data, tiny_policy_dir):
    """A checkpoint cut short (an interrupted copy) is refused before any stage runs, with its size;
    as a process, so no traceback reaches the terminal either."""
    cut = data / "cut_model"
    shutil.copytree(tiny_policy_dir, cut)
    weights = cut / "model.safetensors"
    whole = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: whole // 2])
    code, out = script("run", preset(data, cut), "--local", "--run-dir", data / "run", cwd=data)
    assert code == 2, out
    assert_user_error(out, "model.base", f"{weights} is {whole // 2} bytes, but its header promises {whole}",
                      "save the checkpoint again")


def test_text_that_is_not_utf8(data, tiny_policy_dir):
    (data / "latin1.csv").write_bytes(b"prompt,answer\n1+1=,2\ncaf\xe9 2+2=,4\n")
    code, out = script("data", "import", "latin1.csv", "out", cwd=data)
    assert code == 2, out
    assert_user_error(out, "latin1.csv: column 'prompt' holds text that is not UTF-8", "at line 3", "iconv")
    assert not (data / "out").exists()
    # the same file named by a preset: refused when the run imports it, before anything else runs
    code, out = cli("run", preset(data, tiny_policy_dir, data={"prompts": str(data / "latin1.csv")}),
                    "--local", "--run-dir", data / "run")
    assert code == 2
    assert_user_error(out, "latin1.csv: column 'prompt'", "at line 3")


def test_reward_model_without_named_pairs(data, tiny_policy_dir):
    """A preset that trains a reward model but names no pairs (no data.preferences, no
    preferences.kind) is refused before any stage, saying how to give pairs: it is not trained on
    pairs made up from the prompts without a word."""
    rm = [{"name": "rm", "type": "reward_model", "checkpoint": "reward_model"}]
    code, out = cli("run", preset(data, tiny_policy_dir, sft={"max_steps": 1}, reward_model={"epochs": 1},
                                  score={"components": rm}), "--local", "--run-dir", data / "run")
    assert code == 2
    assert_user_error(out, f"{data}/mine.yaml", "reward_model section trains a reward model",
                      "data.preferences=FILE", "preferences.kind=answers")
    assert not (data / "run").exists()


def test_reward_model_without_preferences(data, tiny_policy_dir):
    """Prompts whose answers are not integers cannot give the built-in near-miss pairs: the run
    says to supply preference pairs (or a reward model), and says it before SFT."""
    (data / "words.jsonl").write_text('{"prompt": "say hi", "answer": "hi"}\n{"prompt": "say yo", "answer": "yo"}\n')
    rm = [{"name": "rm", "type": "reward_model", "checkpoint": "reward_model"}]
    code, out = cli("run", preset(data, tiny_policy_dir, data={"prompts": str(data / "words.jsonl")},
                                  sft={"max_steps": 1}, reward_model={"epochs": 1}, score={"components": rm},
                                  preferences={"kind": "answers"}),
                    "--local", "--run-dir", data / "run")
    assert code == 2
    assert_user_error(out, "has answer 'hi', not an integer", "row 0", "data.preferences", "--kind preferences",
                      "model.reward_model")
    assert not (data / "run" / "models" / "sft").exists()
    # the stage alone, without its preferences key
    code, out = cli("stage", "reward_model", f"base={tiny_policy_dir}", f"output={data}/rm")
    assert code == 2
    assert_user_error(out, "missing required key 'preferences'")


def test_duplicate_prompt_ids(data, tiny_policy_dir):
    (data / "dup.jsonl").write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n{"id": "a", "prompt": "z"}\n')
    code, out = cli("data", "import", data / "dup.jsonl", data / "out", "--id", "id")
    assert code == 2
    assert_user_error(out, "dup.jsonl: column 'id' repeats ids: 'a' at lines 1, 3", "remove the repeats or fix the ids")
    # an artifact some other writer made with repeated ids: the rollout stage refuses it by row
    rows = [{"prompt_id": pid, "prompt": p, "messages": None, "answer": "2", "metadata": None}
            for pid, p in (("a", "1+1="), ("b", "2+0="), ("a", "0+2="))]
    write_table_artifact(data / "dup_prompts", PROMPTS, pa.Table.from_pylist(rows, schema=PROMPTS.arrow()),
                         stage="test")
    code, out = cli("stage", "rollout", f"checkpoint={tiny_policy_dir}", f"prompts={data}/dup_prompts",
                    f"output={data}/rollouts", "max_new_tokens=2", "group_size=2")
    assert code == 2
    assert_user_error(out, f"prompts artifact {data}/dup_prompts: column 'prompt_id' repeats ids", "rows 0, 2",
                      "give every prompt its own id")
    assert not (data / "rollouts").exists()


def test_empty_prompts(data):
    (data / "empty.jsonl").write_text('{"prompt": "1+1="}\n{"prompt": "  "}\n{"prompt": "2+2="}\n')
    code, out = cli("data", "import", data / "empty.jsonl", data / "out")
    assert code == 2
    assert_user_error(out, "empty.jsonl: column 'prompt' is empty", "at line 2", "remove those rows or fill them in")


def test_output_equal_to_an_input(data, tiny_policy_dir):
    code, out = cli("stage", "sft", f"base={tiny_policy_dir}", f"prompts={data}/prompts", f"output={tiny_policy_dir}")
    assert code == 2
    assert_user_error(out, "output 'output'", "overlaps input 'base'", str(tiny_policy_dir), "choose another output path")


def test_unknown_preset_key(tmp_path):
    code, out = script("run", "grpo", "rollout.temprature=0.5", "--local", "--run-dir", tmp_path / "run", cwd=tmp_path)
    assert code == 2, out
    assert_user_error(out, "(rollout)", "unknown key 'temprature'", "allowed keys:", "temperature")
    code, out = cli("run", "grpo", "iteratoins=3", "--local", "--run-dir", tmp_path / "run")
    assert code == 2
    assert_user_error(out, "unknown key 'iteratoins'", "iterations")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("given", "named"), [
    ("num_generations=8", "rollout.group_size"), ("rollout.num_generations=8", "rollout.group_size"),
    ("num_iterations=2", "optimize.epochs"), ("optimize.beta=0.1", "optimize.kl_beta")])
def test_a_trl_name_gets_one_line_naming_rlpipes_key(tmp_path, given, named):
    code, out = cli("run", "grpo", given, "--local", "--run-dir", tmp_path / "run")
    assert code == 2, out
    trl = given.split("=")[0].rsplit(".", 1)[-1]
    # (a key inside a stage's section is named within that stage's config: 'beta' of optimize)
    message = assert_user_error(out, f"unknown key '{trl}'", f"TRL's {trl} is rlpipe's {named}")
    [line] = [line for line in message.splitlines() if "unknown key" in line]  # one line, no key list
    assert "allowed keys" not in line
    assert not (tmp_path / "run").exists()


def test_unknown_stage_name(tmp_path):
    code, out = script("stage", "scroe", cwd=tmp_path)
    assert code == 2, out
    assert_user_error(out, "unknown stage 'scroe'", "stages: ", "score")


# -- problems found only while a stage runs: the same boundary (stages.common.cli.report_failure) --
def test_corrupt_json_in_a_checkpoint(data, tiny_policy_dir):
    broken = shutil.copytree(tiny_policy_dir, data / "broken")
    (broken / "config.json").write_text('{"model_type": "llama", ')  # cut short
    code, out = script("run", preset(data, broken), "--local", "--run-dir", data / "run", cwd=data)
    assert code == 2, out
    assert_user_error(out, "model.base", f"{broken}/config.json is not valid JSON", "save it again")
    code, out = cli("stage", "rollout", f"checkpoint={broken}", f"prompts={data}/prompts", f"output={data}/r")
    assert code == 2
    assert_user_error(out, "checkpoint:", f"{broken}/config.json is not valid JSON")
    assert not (data / "r").exists()


def test_a_prompt_too_long_for_the_model(data, tiny_policy_dir):
    """Found at run time (the tokens are counted by the rollout stage): still one paragraph, exit 2."""
    rows = [{"prompt": " ".join(["1+1="] * 200), "answer": "2"}, *PROMPT_ROWS]
    (data / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out = cli("data", "import", data / "long.jsonl", data / "long")
    assert code == 0, out
    code, out = script("stage", "rollout", f"checkpoint={tiny_policy_dir}", f"prompts={data}/long",
                       f"output={data}/r", "max_new_tokens=8", cwd=data)
    assert code == 2, out
    assert_user_error(out, "rollout:", f"of {data}/long is too long", "tokens", "context of 256")
    assert not (data / "r").exists() and not list(data.glob(".r.staging*"))


def test_a_prompts_artifact_with_no_rows(data, tiny_policy_dir):
    write_table_artifact(data / "none", PROMPTS, {c: [] for c in PROMPTS.column_names}, stage="test")
    code, out = script("stage", "rollout", f"checkpoint={tiny_policy_dir}", f"prompts={data}/none",
                       f"output={data}/r", cwd=data)
    assert code == 2, out
    assert_user_error(out, f"prompts artifact {data}/none has no rows")


def test_an_artifact_of_an_old_schema_version(data, tiny_policy_dir):
    """prompts v1 (before `messages`) still reads; a v1 shard lacking a column v1 could not lack is
    refused naming both versions and the command that rewrites it."""
    from dataclasses import replace

    v1 = replace(PROMPTS, version=1, columns=tuple(c for c in PROMPTS.columns if c.name != "messages"))
    rows = {"prompt_id": ["a", "b"], "prompt": ["1+1=", "2+2="], "answer": ["2", "4"], "metadata": [None, None]}
    write_table_artifact(data / "v1", v1, rows, stage="import_data")
    code, out = cli("stage", "rollout", f"checkpoint={tiny_policy_dir}", f"prompts={data}/v1", f"output={data}/r",
                    "max_new_tokens=2", "group_size=2")
    assert code == 0, out  # read with messages = null
    broken = replace(v1, columns=tuple(c for c in v1.columns if c.name != "answer"))
    write_table_artifact(data / "v1b", broken, {k: v for k, v in rows.items() if k != "answer"}, stage="import_data")
    code, out = cli("stage", "rollout", f"checkpoint={tiny_policy_dir}", f"prompts={data}/v1b", f"output={data}/r2")
    assert code == 2
    assert_user_error(out, f"{data}/v1b/part-00000.parquet", "schema 'prompts' v1, which this rlpipe (v2) cannot read",
                      "missing column 'answer'", "--force")


def test_a_bug_says_so(data, tiny_policy_dir, monkeypatch):
    """Anything that is not the user's or the machine's problem keeps its traceback and says it is
    a bug in rlpipe, exit 1."""
    from rlpipe.stages.rollout import run as rollout_run

    monkeypatch.setattr(rollout_run, "_tokenize", lambda *a: [][1])  # an IndexError inside rlpipe
    result = CliRunner().invoke(app, ["stage", "rollout", f"checkpoint={tiny_policy_dir}", f"prompts={data}/prompts",
                                      f"output={data}/r"])
    assert result.exit_code == 1
    assert "IndexError" in result.output and "this is a bug in rlpipe" in result.output
