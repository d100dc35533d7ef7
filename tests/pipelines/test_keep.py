"""keep: a run deletes the checkpoints and train states its `keep:` rule no longer keeps
(pipelines/keep.py), leaving a record of each (schemas/pruning.py); it resumes after a kill and
extends past them to the content hashes of a run that deleted nothing. So does an asynchronous run
that saves its train state every 3 iterations and keeps no tables, whose resume replays optimize
runs from what the rule kept for them. `rlpipe prune` applies the rule to a run directory; a stage
whose input was pruned fails naming it and the keep setting."""

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
from conftest import KEEP_EVERYTHING, MINI

from rlpipe.pipelines.keep import TABLES, Keep, deletions
from rlpipe.schemas.pruning import PRUNED_NAME

#: The test-only `rlpipe` launcher that holds a chosen call for a kill (tests/reliability).
PAUSE_DRIVER = Path(__file__).resolve().parents[1] / "reliability" / "pause_driver.py"

#: MINI, 6 iterations evaluated every 2 (iterations 1, 3, 5), each saving its train state, with the
#: default keep but for a period of 3 (iterations 2 and 5): train states 4 and 5 stay, policies 2,
#: 5 and the best.
PRUNED = {**MINI, "iterations": 6, "eval_every": 2, "keep": {"checkpoints_every": 3},
          "optimize": {**MINI["optimize"], "state_every": 1},
          "score": {"components": [*MINI["score"]["components"],
                                   {"name": "alnum", "type": "regex_format", "pattern": "[0-9A-Za-z]"}]}}
#: The same run keeping everything.
EVERYTHING = {**PRUNED, "keep": KEEP_EVERYTHING}
#: PRUNED, asynchronous (rollout k samples from policy k-2) and saving the train state every 3
#: iterations (2 and 5: optimize 3 and 4 continue from 2), with the default keep but for
#: `tables: false`: what keeps the tables, the policies a rollout samples from and what a replay
#: reads is the staleness and the state chain.
REPLAYED = {**PRUNED, "async": {"staleness": 1}, "optimize": {**MINI["optimize"], "state_every": 3},
            "keep": {"tables": False}}


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


def _run_in_process(root: Path, preset: dict, *overrides: str) -> Path:
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.pipelines.runner import Pipeline

    (root / "p.yaml").write_text(yaml.safe_dump(preset))
    Pipeline(load_preset(root / "p.yaml", list(overrides)), root / "runs" / "mini", log=lambda s: None).run()
    return root / "runs" / "mini"


@pytest.fixture(scope="module")
def everything(tmp_path_factory) -> Path:
    """The run keeping everything, 8 iterations: what every pruned run must compute."""
    return _run_in_process(tmp_path_factory.mktemp("everything"), EVERYTHING, "iterations=8")


@pytest.fixture(scope="module")
def replayed_everything(tmp_path_factory) -> Path:
    """REPLAYED keeping everything, 7 iterations: what the pruned REPLAYED run must compute."""
    return _run_in_process(tmp_path_factory.mktemp("replayed"), {**REPLAYED, "keep": KEEP_EVERYTHING},
                           "iterations=7")


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


@pytest.mark.integration
@pytest.mark.slow
def test_async_state_every_3_without_tables_prunes_resumes_after_a_kill_and_extends(replayed_everything, tmp_path):
    from rlpipe.schemas import read_manifest

    preset = tmp_path / "p.yaml"
    preset.write_text(yaml.safe_dump(REPLAYED))
    run_dir = tmp_path / "runs" / "mini"
    argv = ("run", str(preset), "--local", "--run-dir", str(run_dir))
    # Killed in iteration 5 before its optimize, which continues from train state 2 and replays
    # optimize 3 and 4: their inputs (policy 2, kept for that alone, and tables 3 and 4) must have
    # survived iteration 4's prune, which deleted tables 0-2 and policies 0 and 1.
    # (optimize 5, the process's 6th optimize call, is held by the test-only launcher's pause while
    # the driver lane finishes and prunes iteration 4: a kill point, not a race between the lanes)
    hold = tmp_path / "held"
    env = {"RLPIPE_TEST_PAUSE": "rlpipe.stages.optimize.run:run@6", "RLPIPE_TEST_PAUSE_FILE": str(hold)}
    killed = subprocess.Popen([sys.executable, str(PAUSE_DRIVER), *argv], cwd=tmp_path,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not (hold.is_file() and (run_dir / "iter_0005" / "advantages" / "_manifest.json").is_file()
               and (run_dir / "iter_0002" / "rollouts" / PRUNED_NAME).is_file()):
        if killed.poll() is not None or time.monotonic() > deadline:
            killed.kill()  # (held at the pause, it would never end by itself)
            raise AssertionError(f"not at the kill point within 300 s (held: {hold.is_file()}):\n"
                                 f"{killed.communicate()[0][-3000:]}")
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    before_kill = killed.communicate()[0]
    assert 5 not in _complete(run_dir, "policy"), "killed too late: iteration 5's optimize had finished"
    assert _pruned(run_dir, "rollouts") == [0, 1, 2] and _pruned(run_dir, "policy") == sorted({0, 1} - {_best(run_dir)})
    assert "pruned iter_0002/rollouts (" in before_kill and "keep.tables=false" in before_kill
    done = _rlpipe(tmp_path, *argv)
    out = done.communicate(timeout=600)[0]
    assert done.returncode == 0, out
    # (a new process: no warm engine held the state of optimize 4)
    assert read_manifest(run_dir / "iter_0005" / "policy").extra["timing"]["replayed_runs"] == 2.0

    # Train states 2 and 5; policies 5 (last), 4 (rollout 6 samples from it: staleness 1) and the
    # best evaluated; tables of 4 and 5 (last - staleness on); metrics and evaluations all.
    assert _complete(run_dir, "train_state") == [2, 5] and _pruned(run_dir, "train_state") == []
    assert _complete(run_dir, "policy") == sorted({4, 5, _best(run_dir)})
    assert _pruned(run_dir, "policy") == sorted({0, 1, 2, 3} - {_best(run_dir)})
    for table in ("rollouts", "scores", "advantages"):
        assert (_complete(run_dir, table), _pruned(run_dir, table)) == ([4, 5], [0, 1, 2, 3]), table
    assert not any(_complete(run_dir, t) or _pruned(run_dir, t) for t in set(TABLES) - {"rollouts", "scores", "advantages"})
    assert _complete(run_dir, "metrics") == list(range(6)) and _complete(run_dir, "eval") == [1, 3, 5]
    assert "pruned iter_0003/rollouts (" in out
    # everything it holds or held has the content of the run that deleted nothing
    ours = _all_hashes(run_dir)
    assert ours == {k: v for k, v in _all_hashes(replayed_everything).items() if int(k[5:9]) < 6}

    # extended by one iteration: rollout 6 samples from policy 4, optimize 6 continues from state 5
    more = _rlpipe(tmp_path, *argv, "iterations=7")
    out = more.communicate(timeout=600)[0]
    assert more.returncode == 0, out
    assert _complete(run_dir, "train_state") == [5, 6] and _complete(run_dir, "policy") == sorted({5, 6, _best(run_dir)})
    assert _all_hashes(run_dir) == _all_hashes(replayed_everything)


def _best(run_dir: Path) -> int:
    """The evaluated iteration of the highest held-out accuracy (the earliest of equals): keep.best."""
    return max(_complete(run_dir, "eval"), key=lambda k: (_eval(run_dir, k), -k))


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
    assert deletions(run_dir, Keep(train_states=2, checkpoints_every=0, best=None)) == []  # nothing more to do

    # rerunning iteration 3's optimize needs iteration 2's policy, which is gone: one error naming it
    from rlpipe.stages.common.cli import stage_main

    config = run_dir / "iter_0003" / "configs" / "optimize.yaml"
    assert stage_main("optimize", ["-c", str(config)]) == 0  # unchanged: a cache hit, nothing read
    done = subprocess.run([sys.executable, "-m", "rlpipe.stages.optimize", "-c", str(config), "--force"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "error: optimize: policy:" in done.stderr and "iter_0002/policy was pruned" in done.stderr
    assert "keep.checkpoints_every=0" in done.stderr
