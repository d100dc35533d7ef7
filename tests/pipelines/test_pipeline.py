"""The pipeline end to end on a miniature preset: layout, resume, rerunning one stage alone."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlpipe.pipelines.preset import load_preset
from rlpipe.pipelines.runner import Pipeline
from rlpipe.schemas import read_manifest
from rlpipe.schemas.runs import iteration_dir_name

ARTIFACTS = ("rollouts", "scores", "advantages", "policy", "metrics", "eval")


def _hashes(run_dir: Path) -> dict[str, str]:
    """content hash of every artifact (a directory with a manifest) of a run, by relative path."""
    return {str(m.parent.relative_to(run_dir)): json.loads(m.read_text())["content_hash"]
            for m in sorted(run_dir.rglob("_manifest.json"))}


def _created(run_dir: Path) -> dict[str, str]:
    return {str(m.parent.relative_to(run_dir)): json.loads(m.read_text())["created_at"] + m.read_text()
            for m in sorted(run_dir.rglob("_manifest.json"))}


@pytest.mark.integration
@pytest.mark.keep_everything  # every iteration's policy is looked at
def test_pipeline_writes_the_layout_and_a_rerun_recomputes_nothing(mini_preset_file, tmp_path):
    run_dir = tmp_path / "runs" / "mini"
    lines: list[str] = []
    records = Pipeline(load_preset(mini_preset_file), run_dir, log=lines.append).run()
    assert [r.iteration for r in records] == [0, 1]
    for k in (0, 1):
        for name in ARTIFACTS:
            assert (run_dir / iteration_dir_name(k) / name / "_manifest.json").is_file(), (k, name)
        assert (run_dir / iteration_dir_name(k) / "configs" / "optimize.yaml").is_file()
    # the policy of iteration 1 was trained from iteration 0's policy
    assert read_manifest(run_dir / "iter_0001/policy").inputs["policy"].path == str(run_dir / "iter_0000/policy")
    assert (run_dir / "report" / "curves.png").stat().st_size > 1000
    assert "| iteration |" in (run_dir / "report" / "metrics.md").read_text()
    assert any(line.startswith("iter   2/2") for line in lines)

    before = _created(run_dir)
    Pipeline(load_preset(mini_preset_file), run_dir, log=lines.append).run()
    assert _created(run_dir) == before  # every stage was a cache hit: no manifest rewritten

    # A copy of the run directory elsewhere (same folder name: the run name is a column of the
    # artifacts) reruns as all cache hits too: cache keys hold contents, not paths.
    copy = shutil.copytree(run_dir, tmp_path / "elsewhere" / "mini")
    Pipeline(load_preset(mini_preset_file), copy, log=lines.append).run()
    assert _created(copy) == before


@pytest.mark.integration
@pytest.mark.keep_everything  # rollout 1 rerun alone samples from iteration 0's policy
def test_rerunning_one_stage_alone_reproduces_the_flow_artifact(mini_preset_file, tmp_path):
    run_dir = tmp_path / "runs" / "mini"
    Pipeline(load_preset(mini_preset_file), run_dir, log=lambda s: None).run()
    for stage, artifact in (("score", "scores"), ("advantage", "advantages"), ("rollout", "rollouts")):
        out = tmp_path / f"again_{artifact}"
        subprocess.run(
            [sys.executable, "-m", "rlpipe.pipelines.cli", "stage", stage,
             "-c", str(run_dir / "iter_0001/configs" / f"{stage}.yaml"), f"output={out}"],
            check=True, capture_output=True, text=True,
        )
        assert read_manifest(out).content_hash == read_manifest(run_dir / "iter_0001" / artifact).content_hash


def test_a_different_preset_in_the_same_run_dir_is_refused(mini_preset_file, tmp_path):
    from rlpipe.schemas.config_files import ConfigError

    run_dir = tmp_path / "runs" / "mini"
    run_dir.mkdir(parents=True)
    (run_dir / "preset.yaml").write_text("name: other\n")
    with pytest.raises(ConfigError, match="different preset"):
        Pipeline(load_preset(mini_preset_file), run_dir).run()


@pytest.mark.integration
@pytest.mark.slow
def test_killed_run_resumes_and_matches_an_uninterrupted_run(mini_preset_file, tmp_path):
    """SIGKILL in the middle of iteration 1 (after its advantages), rerun the same command: the
    finished stages are not recomputed, and every artifact equals an uninterrupted run's."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "rlpipe.pipelines.cli", "run", str(mini_preset_file), "--local"]
    straight = tmp_path / "straight" / "mini"  # same run name: it is recorded in the rows
    subprocess.run([*cmd, "--run-dir", str(straight)], check=True, capture_output=True, env=env)

    killed = tmp_path / "killed" / "mini"
    proc = subprocess.Popen([*cmd, "--run-dir", str(killed)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    marker = killed / "iter_0001" / "advantages" / "_manifest.json"
    deadline = time.time() + 300
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists(), "the run ended before the kill point"
    done_at_kill = _created(killed)
    assert "iter_0001/eval" not in done_at_kill  # killed mid-iteration

    subprocess.run([*cmd, "--run-dir", str(killed)], check=True, capture_output=True, env=env)
    after = _created(killed)
    assert {k: after[k] for k in done_at_kill} == done_at_kill  # nothing finished was recomputed
    assert _hashes(killed) == _hashes(straight)  # and the result is the uninterrupted run's


@pytest.mark.integration
@pytest.mark.slow
def test_ppo_preset_runs_end_to_end(tmp_path):
    """The PPO path: reward model trained first, critic built, reference log-probs, GAE with KL in
    the reward, critic trained by optimize; every artifact of the iteration exists and validates."""
    from rlpipe.schemas import validate_artifact

    preset = load_preset("ppo", ["iterations=1", "sft.max_steps=5", "base_model.size=micro",
                                 "prompts_per_iteration=8", "data.task.n_train=60", "data.task.n_heldout=10",
                                 "optimize.minibatch_size=8", "optimize.micro_batch_size=8"])
    run_dir = tmp_path / "ppo"
    Pipeline(preset, run_dir, log=lambda s: None).run()
    it = run_dir / "iter_0000"
    for name in ("rollouts", "scores", "reference", "advantages", "policy", "critic", "metrics", "eval"):
        assert validate_artifact(it / name) == [], name
    adv = read_manifest(it / "advantages")
    assert adv.config["estimator"]["name"] == "gae" and adv.config["kl"]["in_reward"] is True
    assert read_manifest(it / "critic").inputs["critic"].path == str(run_dir / "models/critic")
    assert read_manifest(run_dir / "models/reward").kind == "checkpoint"
