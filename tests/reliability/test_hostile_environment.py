"""Malformed inputs beyond files: reward functions that misbehave, a full disk, read-only
directories, concurrent writers, bad presets. Each must stop with its exit code and a message
naming the component, file or owner, and leave what was there whole."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from reliability.helpers import tree_digest
from typer.testing import CliRunner

from rlpipe.pipelines.cli import app
from rlpipe.pipelines.lock import run_lock
from rlpipe.schemas import ROLLOUTS, ArtifactWriter, read_table_artifact, validate_artifact
from rlpipe.schemas.examples import example_table
from rlpipe.stages.common.cli import stage_main

pytestmark = pytest.mark.reliability

IT = "iter_0001"
HERE = Path(__file__).parent


@pytest.fixture
def run(reference_run, tmp_path):
    """A copy of the reference run to break."""
    copy = tmp_path / "mini"
    shutil.copytree(reference_run, copy)
    return copy


def _score(run: Path, function: str, capsys, **component) -> tuple[int, str]:
    """`rlpipe stage score --force` over the complete scores of iteration 1, with one python
    component `function` added."""
    extra = ", ".join(f"{k}: {json.dumps(v)}" for k, v in component.items())
    components = ("components=[{name: correct, type: answer_match, mode: exact}, "
                  f"{{name: hostile, type: python, function: '{function}'{', ' + extra if extra else ''}}}]")
    code = stage_main("score", ["-c", str(run / IT / "configs/score.yaml"), components, "--force"])
    return code, capsys.readouterr().err


# -- reward functions -------------------------------------------------------------------------
REWARDS = [
    ("hostile_rewards:exits", {}, ["'hostile' (python)", "SystemExit(0) inside a reward function"]),
    ("hostile_rewards:interrupts", {}, ["'hostile' (python)", "KeyboardInterrupt() inside a reward function"]),
    ("hostile_rewards:sleeps", {"timeout_s": 0.5}, ["'hostile' (python)", "no result within 0.5 s"]),
    ("hostile_rewards:spins", {"timeout_s": 0.5}, ["'hostile' (python)", "no result within 0.5 s"]),
    ("hostile_rewards:raises", {}, ["'hostile' (python)", "rows 0..15", "ZeroDivisionError"]),
    ("hostile_rewards:nan_at_1", {}, ["'hostile' (python)", "row 1 (group_id=", "returned nan"]),
    ("hostile_rewards:too_few", {}, ["'hostile' (python)", "returned 15 values for 16 rows"]),
    ("hostile_rewards:words", {}, ["'hostile' (python)", "row 0 (group_id=", "'high', not a number"]),
    ("hostile_rewards:missing", {}, ["'hostile' (python)", "hostile_rewards:missing"]),
    ("hostile_rewards:NOT_CALLABLE", {}, ["'hostile' (python)", "is a int, not a function"]),
    ("no_such_module:fn", {}, ["'hostile' (python)", "no_such_module"]),
    ("hostile_rewards:dies", {"isolate": True}, ["'hostile' (python)", "worker process", "died (exit code 3)"]),
    ("hostile_rewards:sleeps", {"isolate": True, "timeout_s": 1.0}, ["'hostile' (python)", "no result within 1 s"]),
    ("hostile_rewards:exits", {"isolate": True}, ["'hostile' (python)", "SystemExit(0) inside a reward function"]),
]


@pytest.mark.parametrize("function, options, names", REWARDS,
                         ids=[f"{f.partition(':')[2]}{' isolated' if o.get('isolate') else ''}" for f, o, _ in REWARDS])
def test_hostile_reward_function_is_contained(function, options, names, run, capsys, monkeypatch):
    """A --force rerun of complete scores with a hostile component: exit 2 naming the component,
    the old scores whole (the issue's data-loss case), nothing left behind."""
    monkeypatch.syspath_prepend(str(HERE))
    before = tree_digest(run)
    code, err = _score(run, function, capsys, **options)
    assert code == 2, err
    for text in names:
        assert text in err, f"{text!r} not in:\n{err}"
    assert tree_digest(run) == before


# -- the disk, permissions, other writers -----------------------------------------------------
@pytest.fixture
def tmpfs(tmp_path):
    """A 1 MiB tmpfs (root only; skipped where mounting is not allowed)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root): disk-full and read-only cases not run")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(mnt: Path, leave: int) -> None:
    """Fill the file system but `leave` bytes."""
    st = os.statvfs(mnt)
    (mnt / "filler").write_bytes(b"\0" * max(st.f_bavail * st.f_frsize - leave, 0))


def test_disk_full_while_writing_shards(run, tmpfs, capsys):
    _fill(tmpfs, 0)
    before = tree_digest(run)
    code = stage_main("score", ["-c", str(run / IT / "configs/score.yaml"), f"output={tmpfs}/scores"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{tmpfs}/scores" in err and "No space left on device" in err
    assert sorted(p.name for p in tmpfs.iterdir()) == ["filler"]  # no partial artifact, no staging
    assert tree_digest(run) == before


def test_disk_full_while_saving_a_checkpoint(run, tmpfs, capsys):
    _fill(tmpfs, 40_000)  # the micro model's weights are ~110 kB
    before = tree_digest(run)
    code = stage_main("base_model", ["-c", str(run / "configs/base_model.yaml"), f"output={tmpfs}/base"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{tmpfs}/base: no space left on the device holding {tmpfs}" in err and "Traceback" not in err
    assert sorted(p.name for p in tmpfs.iterdir()) == ["filler"]
    assert tree_digest(run) == before


def test_disk_full_while_optimize_saves_its_train_state(run, tmpfs, capsys):
    """The policy (~110 kB) fits, the train state (fp32 masters and AdamW moments: ~3x that) does
    not: torch.save's own error ("unexpected pos") becomes "no space left", the policy written
    before it stays complete, nothing partial is left."""
    _fill(tmpfs, 300_000)
    before = tree_digest(run)
    code = stage_main("optimize", ["-c", str(run / IT / "configs/optimize.yaml"), f"output={tmpfs}/policy",
                                   f"metrics_output={tmpfs}/metrics", f"train_state_output={tmpfs}/state"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{tmpfs}/state: no space left on the device holding {tmpfs}" in err and "Traceback" not in err
    assert sorted(p.name for p in tmpfs.iterdir()) == ["filler", "metrics", "policy"]  # no staging left
    assert validate_artifact(tmpfs / "policy") == [] and validate_artifact(tmpfs / "metrics") == []
    assert tree_digest(run) == before


@pytest.fixture
def read_only_run(run, tmp_path):
    """The run behind a read-only bind mount of itself (root only; skipped where not allowed): a
    tmpfs would have to hold the run's training state, megabytes."""
    ro = tmp_path / "read-only" / run.name  # the run's name is its folder's
    shutil.copytree(run, ro)
    if subprocess.run(["mount", "--bind", str(ro), str(ro)], capture_output=True).returncode:
        pytest.skip("cannot bind-mount here (needs root): read-only case not run")
    try:
        assert subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True).returncode == 0
        yield ro
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


def test_read_only_run_directory(read_only_run, capsys):
    """A complete run on a read-only mount reruns (every stage cached; no lock, nothing written);
    a stage asked to write there stops naming the path."""
    ro = read_only_run
    before = tree_digest(ro)
    code = stage_main("score", ["-c", str(ro / IT / "configs/score.yaml"), f"output={ro}/{IT}/scores2"])
    err = capsys.readouterr().err
    assert code == 2 and f"{ro}/{IT}/scores2: cannot create its staging directory" in err, err
    assert "Read-only file system" in err
    r = CliRunner().invoke(app, ["run", str(ro / "preset.yaml"), "--local", "--run-dir", str(ro)])
    assert r.exit_code == 0, r.output
    assert "not writable: no run lock taken" in r.output
    # extending it needs writing: one error naming where, no traceback
    r = CliRunner().invoke(app, ["run", str(ro / "preset.yaml"), "--local", "--run-dir", str(ro), "iterations=3"])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and f"{ro}/preset.yaml is on a read-only filesystem" in r.output, r.output
    assert tree_digest(ro) == before


def test_a_second_writer_is_refused_naming_the_owner(run):
    before = tree_digest(run)
    with run_lock(run, log=lambda s: None):  # another open of the lock file: a second writer
        r = CliRunner().invoke(app, ["run", str(run / "preset.yaml"), "--local", "--run-dir", str(run)])
        assert r.exit_code == 2, r.output
        assert f"{run} is in use by pid {os.getpid()} on host" in r.output and f"{run}/.lock" in r.output
    assert {k: v for k, v in tree_digest(run).items() if k != ".lock"} == before


def test_a_stale_lock_is_taken_over(run):
    (run / ".lock").write_text(json.dumps({"pid": 2 ** 22 + 1, "host": os.uname().nodename, "started": "then"}))
    before = tree_digest(run)
    r = CliRunner().invoke(app, ["run", str(run / "preset.yaml"), "--local", "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    assert f"taking over the stale lock of pid {2 ** 22 + 1}" in r.output
    after = tree_digest(run)
    assert not (run / ".lock").exists() and {k: after[k] for k in after if not k.startswith("report")} == \
        {k: v for k, v in before.items() if k != ".lock" and not k.startswith("report")}


# Another process writes the same artifact at the same time (no run lock around `rlpipe stage`):
# it stops after its first shard until the test's writer has committed, then commits its own.
OTHER_WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from rlpipe.schemas import ROLLOUTS, ArtifactWriter
    from rlpipe.schemas.examples import example_table
    out, wrote, go = map(Path, sys.argv[1:4])
    w = ArtifactWriter(out, ROLLOUTS, stage="other")
    w.write_shard(example_table(ROLLOUTS, 4, seed=1), index=0)
    wrote.touch()
    while not go.exists():
        time.sleep(0.01)
    w.write_shard(example_table(ROLLOUTS, 4, seed=2), index=1)
    w.commit()
""")


def test_concurrent_writers_of_one_artifact_never_delete_each_others_files(tmp_path):
    out, wrote, go = tmp_path / "rollouts", tmp_path / "wrote", tmp_path / "go"
    script = tmp_path / "other.py"
    script.write_text(OTHER_WRITER)
    other = subprocess.Popen([sys.executable, str(script), str(out), str(wrote), str(go)],
                             stderr=subprocess.PIPE, text=True)
    while not wrote.exists():
        assert other.poll() is None, other.stderr.read()
    mine = ArtifactWriter(out, ROLLOUTS, stage="mine")  # opens while the other is half-way
    mine.write_shard(example_table(ROLLOUTS, 3, seed=3), index=0)
    mine.commit()
    assert read_table_artifact(out).num_rows == 3
    go.touch()
    assert other.wait(timeout=120) == 0, other.stderr.read()  # its staging was left alone
    assert read_table_artifact(out).num_rows == 8 and validate_artifact(out) == []  # the last commit, whole
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".rollouts")) == [".rollouts.lock"] or \
        sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".rollouts")) == []


# -- presets ----------------------------------------------------------------------------------
def test_preset_with_an_unknown_key(run, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((run / "preset.yaml").read_text() + "warp_speed: 9\n")
    r = CliRunner().invoke(app, ["run", str(bad), "--local", "--run-dir", str(tmp_path / "new")])
    assert r.exit_code == 2 and "warp_speed" in r.output and str(bad) in r.output, r.output
    assert not (tmp_path / "new").exists()


def test_preset_file_missing(tmp_path):
    r = CliRunner().invoke(app, ["run", str(tmp_path / "nope.yaml"), "--local", "--run-dir", str(tmp_path / "new")])
    assert r.exit_code == 2 and "nope.yaml" in r.output, r.output
    assert not (tmp_path / "new").exists()


def test_a_different_preset_in_a_run_directory(run):
    before = tree_digest(run)
    r = CliRunner().invoke(app, ["run", str(run / "preset.yaml"), "--local", "--run-dir", str(run), "seed=1"])
    assert r.exit_code == 2 and f"{run}/preset.yaml" in r.output and "different preset" in r.output, r.output
    assert tree_digest(run) == before
