"""The README's "Your model, your data" section, run as written: its example file, each line of
its shell block (the installed `rlpipe` script), and its preset through the pipeline plan."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from rlpipe.schemas import read_manifest, read_table_artifact

ROOT = Path(__file__).resolve().parents[3]


def _blocks() -> dict[str, str]:
    """The fenced blocks of the section, by language."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Your model, your data", 1)[1].split("\n## ", 1)[0]
    return {lang: body for lang, body in re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)}


@pytest.fixture
def readme_dir(tmp_path) -> Path:
    (tmp_path / "my_prompts.jsonl").write_text(_blocks()["jsonl"])
    return tmp_path


def test_readme_commands_run_verbatim(readme_dir):
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    lines = [ln for ln in _blocks()["bash"].splitlines() if ln.strip()]
    assert len(lines) == 3
    for line in lines:
        proc = subprocess.run(line, shell=True, cwd=readme_dir, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{line}\n{proc.stdout}{proc.stderr}"
    rows = read_table_artifact(readme_dir / "data/my_prompts").to_pylist()
    source = [json.loads(ln) for ln in _blocks()["jsonl"].splitlines()]
    assert [r["prompt"] for r in rows] == [s["question"] for s in source]
    assert [r["answer"] for r in rows] == [s["solution"] for s in source]
    assert [json.loads(r["metadata"]) for r in rows] == [{"level": s["level"]} for s in source]
    assert len({r["prompt_id"] for r in rows}) == 2 and all(r["messages"] is None for r in rows)
    assert shlex.split(lines[0])[:3] == ["rlpipe", "data", "import"]


def test_readme_preset_imports_the_file_and_later_stages_read_it(readme_dir, monkeypatch):
    from rlpipe.pipelines.layout import RunLayout
    from rlpipe.pipelines.plan import Plan
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.stages import get_stage

    monkeypatch.chdir(readme_dir)
    (readme_dir / "my_run.yaml").write_text(_blocks()["yaml"])
    preset = load_preset(readme_dir / "my_run.yaml")
    plan = Plan(preset, RunLayout(Path("runs") / preset.name))
    setup = plan.setup()
    imported = Path("runs/my_run/data/prompts_train")
    assert setup[0].name == "import_data" and [c.name for c in setup].count("import_data") == 1
    cfg = setup[0].config
    assert cfg.source == Path("my_prompts.jsonl") and cfg.prompts == imported and cfg.prompt == "question"
    evaluate = next(c for c in setup if c.name == "evaluate")
    rollout = plan.iteration(0)[0]
    assert evaluate.config.prompts == imported and rollout.config.prompts == imported

    first = get_stage("import_data").run(cfg)
    assert first.rows == 2
    # Cached by the file's content, not its path: the same bytes under another name import to
    # nothing new; an edited file is imported again.
    (readme_dir / "copy.jsonl").write_bytes((readme_dir / "my_prompts.jsonl").read_bytes())
    again = get_stage("import_data").run(cfg.model_copy(update={"source": Path("copy.jsonl")}))
    assert again.cache_key == first.cache_key and again.created_at == first.created_at
    with (readme_dir / "copy.jsonl").open("a") as f:
        f.write('{"question": "What is 1+1?", "solution": "2", "level": 0}\n')
    edited = get_stage("import_data").run(cfg.model_copy(update={"source": Path("copy.jsonl")}))
    assert edited.rows == 3 and read_manifest(imported).cache_key != first.cache_key
