"""docs/contributing.md: every example block runs, through the stage's real code path, and gives
hand-computed results.

A block is marked `<!-- example: NAME -->` right before its fence; NAME is the file it would be
(`my_estimators.py`, `advantage.yaml`, `stages/length_stats/run.py`). Plug-in modules are written
to a temporary folder on sys.path and named by import path, as a user would; the stage's files are
loaded as the modules `rlpipe.stages.length_stats.*` and registered in `STAGES` for the test only
(as tests/test_cli.py's `fake_stage`), since an in-tree stage needs the registry edit the guide
shows.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from rlpipe.pipelines.cli import app
from rlpipe.schemas import (
    ADVANTAGES,
    METRICS,
    SCORES,
    parse_config,
    read_manifest,
    read_table_artifact,
    validate_artifact,
)
from rlpipe.stages.advantage.config import AdvantageConfig
from rlpipe.stages.advantage.run import run as advantage_run
from rlpipe.stages.common.cli import stage_main
from rlpipe.stages.optimize.config import OptimizeConfig
from rlpipe.stages.optimize.core import PolicyObjective, policy_micro_loss
from rlpipe.stages.score.config import ScoreConfig
from rlpipe.stages.score.run import run as score_run

DOC = Path(__file__).parents[1] / "docs" / "contributing.md"
TESTS = Path(__file__).parent
EXAMPLE = re.compile(r"<!-- example: (\S+) -->\n```(?:python|yaml)\n(.*?)```", re.S)
PLUGINS = ("my_estimators", "my_verifiers", "my_losses")
STAGE_FILES = ("config", "run")


def examples() -> dict[str, str]:
    """NAME -> code of every marked block of the guide (a NAME twice is an error)."""
    found = EXAMPLE.findall(DOC.read_text())
    names = [name for name, _ in found]
    assert len(names) == len(set(names)), f"{DOC}: an example name repeats: {names}"
    return dict(found)


def load_file(path: Path, module: str, monkeypatch) -> types.ModuleType:
    """`path` imported as the module `module` (in sys.modules for this test only)."""
    spec = importlib.util.spec_from_file_location(module, path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, module, mod)  # before exec: pydantic resolves annotations there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def guide(tmp_path, monkeypatch):
    """The guide's examples written under tmp_path/guide/<NAME>, that folder on sys.path; returns
    {NAME: path}. The plug-in modules are forgotten afterwards."""
    root = tmp_path / "guide"
    paths = {}
    for name, code in examples().items():
        paths[name] = root / name
        paths[name].parent.mkdir(parents=True, exist_ok=True)
        paths[name].write_text(code)
    monkeypatch.syspath_prepend(str(root))
    yield paths
    for name in PLUGINS:
        sys.modules.pop(name, None)


@pytest.fixture
def builders(monkeypatch):
    """The artifact builders of tests/stages/{score,advantage}/conftest.py (imported by path: a
    conftest is not importable by name)."""
    score = load_file(TESTS / "stages" / "score" / "conftest.py", "_contributing_score_builders", monkeypatch)
    adv = load_file(TESTS / "stages" / "advantage" / "conftest.py", "_contributing_advantage_builders", monkeypatch)
    return types.SimpleNamespace(rollouts_table=score.rollouts_table, write_rollouts=score.write_rollouts,
                                 score_row=adv.score_row, write_rows=adv.write_rows)


def test_the_guide_has_every_example():
    assert set(examples()) == {
        "my_estimators.py", "advantage.yaml", "my_verifiers.py", "score.yaml", "my_losses.py", "optimize.yaml",
        *(f"stages/length_stats/{f}.py" for f in STAGE_FILES),
    }


def test_estimator_plugin_through_the_advantage_stage(guide, builders, tmp_path):
    # group 7: r = [1, 0, 0.5, 0.5], mean 0.5, range 1 -> [0.5, -0.5, 0, 0] / (1 + eps)
    # group 3: r = [0.3, 0.9], mean 0.6, range 0.6 -> [-0.3, 0.3] / (0.6 + eps)
    # group 5: r = [0.4, 0.4], no signal -> 0
    rewards = {7: [1.0, 0.0, 0.5, 0.5], 3: [0.3, 0.9], 5: [0.4, 0.4]}
    rows = [builders.score_row(g, s, 2, r) for g, rs in rewards.items() for s, r in enumerate(rs)]
    builders.write_rows(tmp_path / "scores", SCORES, rows)
    knobs = yaml.safe_load(guide["advantage.yaml"].read_text())
    config = parse_config(AdvantageConfig, {**knobs, "scores": tmp_path / "scores", "output": tmp_path / "adv"})
    assert config.estimator.function == "my_estimators:range_estimator"
    manifest = advantage_run(config)

    eps = 1e-6
    expected = {(7, 0): 0.5 / (1 + eps), (7, 1): -0.5 / (1 + eps), (7, 2): 0.0, (7, 3): 0.0,
                (3, 0): -0.3 / (0.6 + eps), (3, 1): 0.3 / (0.6 + eps), (5, 0): 0.0, (5, 1): 0.0}
    table = read_table_artifact(tmp_path / "adv", ADVANTAGES).to_pylist()
    got = {(r["group_id"], r["sample_index"]): r["advantage"] for r in table}
    # computed in float64, stored as float32: relative rounding <= 2^-24 (6e-8)
    assert got == {k: pytest.approx(v, rel=1e-7, abs=1e-12) for k, v in expected.items()}
    for r in table:  # a sequence advantage lands on each of the response's 2 tokens
        assert r["token_advantages"] == pytest.approx([got[(r["group_id"], r["sample_index"])]] * 2)
    assert manifest.config["estimator"] == {"name": "custom", "function": "my_estimators:range_estimator",
                                            "kwargs": {"eps": 1e-6}}


def test_verifier_plugin_through_the_score_stage(guide, builders, tmp_path):
    responses = [" 7", " 07", " 7.0", " 8"]
    builders.write_rollouts(tmp_path / "rollouts", builders.rollouts_table(["Q: 3+4= A:"] * 4, responses, ["7"] * 4))
    knobs = yaml.safe_load(guide["score.yaml"].read_text())
    config = parse_config(ScoreConfig, {**knobs, "rollouts": tmp_path / "rollouts", "output": tmp_path / "scores"})
    score_run(config)

    scores = read_table_artifact(tmp_path / "scores", "scores").to_pylist()
    # numeric answer_match accepts 07 and 7.0; the verifier only the answer as written
    assert [s["reward__correct"] for s in scores] == [1.0, 1.0, 1.0, 0.0]
    assert [s["reward__canonical"] for s in scores] == [1.0, 0.0, 0.0, 0.0]
    assert [s["reward"] for s in scores] == [1.5, 0.5, 0.5, 0.0]  # 0.5 * correct + 1.0 * canonical (exact)


def test_loss_plugin_through_the_policy_objective(guide):
    knobs = yaml.safe_load(guide["optimize.yaml"].read_text())
    config = parse_config(OptimizeConfig, {**knobs, "policy": "p", "rollouts": "r", "advantages": "a",
                                           "output": "o", "metrics_output": "m"})
    obj = PolicyObjective(loss=config.loss, agg_mode=config.agg_mode, kl_estimator=config.kl_estimator,
                          kl_beta=config.kl_beta, entropy_coef=config.entropy_coef)
    # row 0: rho = [1, e^0.5 = 1.649] -> weights [1, 1.28]; l = -w A logp = [1 * 1 * 1, 1.28 * 2 * 2] = [1, 5.12]
    # row 1: one real token, rho 1, l = -1 * (-1) * (-0.5) = -0.5; its padding holds garbage
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 9.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0, -2.5], [-0.5, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 2.0], [-1.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    loss, stats = policy_micro_loss(obj, logp, old, adv, mask, token_count=3, seq_count=2, max_len=None)
    assert loss.item() == pytest.approx((1 + 5.12 - 0.5) / 3, rel=1e-12)  # token-mean over 3 tokens
    loss.backward()
    # d l_t / d logp_t = -w_t A_t (the weight is detached), / 3 tokens; 0 on padding
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -2.56], [1.0, 0.0]], dtype=torch.float64) / 3)
    assert stats["ratio_mean"].item() == pytest.approx((1 + 2.718281828459045 ** 0.5 + 1) / 3, rel=1e-12)


@pytest.fixture
def length_stats(guide, monkeypatch):
    """The guide's stage files loaded as rlpipe.stages.length_stats.{config,run}, registered in STAGES."""
    from rlpipe.stages import STAGES, Stage

    package = types.ModuleType("rlpipe.stages.length_stats")
    package.__path__ = [str(guide["stages/length_stats/run.py"].parent)]
    monkeypatch.setitem(sys.modules, package.__name__, package)
    for f in STAGE_FILES:
        load_file(guide[f"stages/length_stats/{f}.py"], f"{package.__name__}.{f}", monkeypatch)
    monkeypatch.setitem(STAGES, "length_stats", Stage("length_stats", "LengthStatsConfig", "response lengths"))


def test_stage_runs_through_the_cli_and_writes_an_artifact(length_stats, builders, tmp_path):
    table = builders.rollouts_table(["q"] * 4, ["a"] * 4, ["1"] * 4, lengths=[1, 3, 4, 10])
    table["iteration"] = [0, 0, 1, 1]
    builders.write_rollouts(tmp_path / "rollouts", table)
    out = tmp_path / "stats"
    args = [f"rollouts={tmp_path / 'rollouts'}", f"output={out}", "long_at=4"]
    r = CliRunner().invoke(app, ["stage", "length_stats", *args])
    assert r.exit_code == 0, r.output
    assert f"length_stats: wrote {out} (4 rows in 1 shard(s)" in r.output

    assert validate_artifact(out, METRICS) == []
    manifest = read_manifest(out)
    assert manifest.stage == "length_stats" and manifest.config["long_at"] == 4
    assert manifest.inputs["rollouts"].content_hash == read_manifest(tmp_path / "rollouts").content_hash
    rows = read_table_artifact(out, METRICS).to_pylist()
    # iteration 0: lengths 1, 3 -> mean 2, none >= 4; iteration 1: 4, 10 -> mean 7, both long
    assert [(m["iteration"], m["name"], m["value"]) for m in rows] == [
        (0, "response_length_mean", 2.0), (0, "long_fraction", 0.0),
        (1, "response_length_mean", 7.0), (1, "long_fraction", 1.0)]

    # the same config again (`python -m rlpipe.stages.length_stats` calls stage_main): a cache hit
    written = (out / "_manifest.json").stat().st_mtime_ns
    assert stage_main("length_stats", args) == 0
    assert (out / "_manifest.json").stat().st_mtime_ns == written
    # --help lists the config keys with their docstrings
    r = CliRunner().invoke(app, ["stage", "length_stats", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "long_at (int, default 64)" in r.output and "counts as long" in r.output
