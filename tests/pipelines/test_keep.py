"""keep: a run deletes the checkpoints and train states its `keep:` rule no longer keeps
(pipelines/keep.py), leaving a record of each (schemas/pruning.py); it resumes after a kill and
extends past them to the content hashes of a run that deleted nothing. `rlpipe prune` applies the
rule to a run directory; a stage whose input was pruned fails naming it and the keep setting."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import MINI

from rlpipe.pipelines.keep import Keep, doomed
from rlpipe.schemas.pruning import PRUNED_NAME

#: MINI, 6 iterations evaluated every 2 (iterations 1, 3, 5), with the default keep but for a
#: period of 3 (iterations 2 and 5): train states 4 and 5 stay, policies 2, 5 and the best.
PRUNED = {**MINI, "iterations": 6, "eval_every": 2, "keep": {"checkpoints_every": 3},
          "score": {"components": [*MINI["score"]["components"],
                                   {"name": "alnum", "type": "regex_format", "pattern": "[0-9A-Za-z]"}]}}
#: The same run keeping everything.
EVERYTHING = {**PRUNED, "keep": {"train_states": None, "checkpoints_every": 1}}


def _complete(run_dir: Path, name: str) -> list[int]:
    return sorted(int(d.parent.name[5:]) for d in run_dir.glob(f"iter_*/{name}") if (d / "_manifest.json").is_file())


def _pruned(run_dir: Path, name: str) -> list[int]:
    return sorted(int(d.parent.name[5:]) for d in run_dir.glob(f"iter_*/{name}") if (d / PRUNED_NAME).is_file())


def _content(path: Path) -> str:
    """The content hash of a complete artifact, or the one a pruned artifact had."""
    for name, key in (("_manifest.json", ("content_hash",)), (PRUNED_NAME, ("manifest", "content_hash"))):
        if (path / name).is_file():
            data = json.loads((path / name).read_text())
            for k in key:
                data = data[k]
            return data
    raise AssertionError(f"{path}: neither complete nor pruned")


def _all_hashes(run_dir: Path) -> dict[str, str]:
    return {str(d.relative_to(run_dir)): _content(d) for d in sorted(run_dir.glob("iter_*/*"))
            if d.name != "configs" and ((d / "_manifest.json").is_file() or (d / PRUNED_NAME).is_file())}


@pytest.fixture(scope="module")
def everything(tmp_path_factory) -> Path:
    """The run keeping everything, 8 iterations: what every pruned run must compute."""
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.pipelines.runner import Pipeline

    root = tmp_path_factory.mktemp("everything")
    (root / "p.yaml").write_text(yaml.safe_dump(EVERYTHING))
    Pipeline(load_preset(root / "p.yaml", ["iterations=8"]), root / "runs" / "mini", log=lambda s: None).run()
    return root / "runs" / "mini"


def _rlpipe(root: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "rlpipe.pipelines.cli", *args], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.integration
@pytest.mark.slow
def test_default_keep_prunes_resumes_after_a_kill_and_extends_identically(everything, tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text(yaml.safe_dump(PRUNED))
    run_dir = tmp_path / "runs" / "mini"
    argv = ("run", str(preset), "--local", "--run-dir", str(run_dir))
    # killed once iteration 4's policy is complete (its train state maybe not yet: written in the background)
    killed = _rlpipe(tmp_path, *argv)
    deadline = time.monotonic() + 300
    while not (run_dir / "iter_0004" / "policy" / "_manifest.json").is_file():
        assert killed.poll() is None and time.monotonic() < deadline, killed.communicate()[0]
        time.sleep(0.01)
    killed.send_signal(signal.SIGKILL)
    before_kill = killed.communicate()[0]
    done = _rlpipe(tmp_path, *argv)
    out = done.communicate(timeout=600)[0]
    assert done.returncode == 0, out

    # 6 iterations, default keep with a period of 3: train states 4 and 5; policies 2 and 5 (period),
    # 5 (last), and the iteration whose evaluation scored best
    assert _complete(run_dir, "train_state") == [4, 5] and _pruned(run_dir, "train_state") == [0, 1, 2, 3]
    best = max((1, 3, 5), key=lambda k: (_eval(run_dir, k), -k))
    assert _complete(run_dir, "policy") == sorted({2, 5, best})
    assert _pruned(run_dir, "policy") == sorted({0, 1, 3, 4} - {best})
    assert all(len(_complete(run_dir, t)) == 6 for t in ("rollouts", "scores", "advantages", "metrics"))
    log = before_kill + out
    assert "pruned iter_0000/train_state (" in log and "keep.train_states=2" in log and "pruned iter_0003/train_state (" in out
    # everything it holds or held has the content of the run that deleted nothing
    ours = _all_hashes(run_dir)
    assert ours == {k: v for k, v in _all_hashes(everything).items() if int(k[5:9]) < 6 and k in ours}
    assert len(ours) >= 6 * 6  # rollouts, scores, advantages, metrics, policy, train_state x 6 (+ evals)

    # extended to 8 iterations: from the kept state and policy, to the same content
    more = _rlpipe(tmp_path, *argv, "iterations=8")
    out = more.communicate(timeout=600)[0]
    assert more.returncode == 0, out
    assert _complete(run_dir, "train_state") == [6, 7]
    assert _all_hashes(run_dir) == {k: v for k, v in _all_hashes(everything).items() if k in _all_hashes(run_dir)}
    assert len(_all_hashes(run_dir)) == len(_all_hashes(everything))


def _eval(run_dir: Path, k: int) -> float:
    from rlpipe.pipelines.report import eval_metrics

    return eval_metrics(run_dir / f"iter_{k:04d}" / "eval")["accuracy"]


@pytest.mark.integration
def test_prune_dry_run_deletes_nothing_then_prunes_and_a_stage_needing_a_pruned_input_says_so(everything, tmp_path):
    import shutil

    from reliability.helpers import tree_digest
    from typer.testing import CliRunner

    from rlpipe.pipelines.cli import app

    run_dir = shutil.copytree(everything, tmp_path / "runs" / "mini")
    before = tree_digest(run_dir)
    keep = ["keep.train_states=2", "keep.checkpoints_every=0", "keep.best=null"]
    dry = CliRunner().invoke(app, ["prune", str(run_dir), "--dry-run", *keep])
    assert dry.exit_code == 0, dry.output
    listed = sorted(line.split()[2] for line in dry.output.splitlines() if line.startswith("would prune"))
    assert listed == sorted([f"iter_{k:04d}/train_state" for k in range(6)] + [f"iter_{k:04d}/policy" for k in range(7)])
    assert "would free" in dry.output and tree_digest(run_dir) == before  # nothing deleted

    wet = CliRunner().invoke(app, ["prune", str(run_dir), *keep])
    assert wet.exit_code == 0, wet.output
    assert sorted(line.split()[1] for line in wet.output.splitlines() if line.startswith("pruned")) == listed
    freed = float(wet.output.split("freed ")[1].split(" MB")[0])
    assert freed > 0 and _complete(run_dir, "train_state") == [6, 7] and _complete(run_dir, "policy") == [7]
    assert doomed(run_dir, Keep(train_states=2, checkpoints_every=0, best=None)) == []  # nothing more to do

    # rerunning iteration 3's optimize needs iteration 2's policy, which is gone: one error naming it
    from rlpipe.stages.common.cli import stage_main

    config = run_dir / "iter_0003" / "configs" / "optimize.yaml"
    assert stage_main("optimize", ["-c", str(config)]) == 0  # unchanged: a cache hit, nothing read
    done = subprocess.run([sys.executable, "-m", "rlpipe.stages.optimize", "-c", str(config), "--force"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "error: optimize: policy:" in done.stderr and "iter_0002/policy was pruned" in done.stderr
    assert "keep.checkpoints_every=0" in done.stderr
