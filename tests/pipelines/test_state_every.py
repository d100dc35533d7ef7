"""optimize.state_every: the train state is saved every N iterations (and by the last one); the
iterations in between continue from it plus the optimize runs since (`replay`).

A tiny GRPO run (fp32, CPU, one thread) saving the state every 2 iterations ends with the same
policies, bit for bit (equal content hashes), as one saving it every iteration: uninterrupted (the
engine stays warm), and stopped after iteration 2 and resumed without its warm engines (as a new
process would: iteration 3 loads iteration 1's state and replays iteration 2's optimize run), and
when iteration 3 is rerun alone from its saved config after the run folder moved. Equal bits, not a tolerance: the same
deterministic kernels on the same inputs from the same state (see stages/optimize/replay.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from conftest import KEEP_EVERYTHING, MINI

from rlpipe.pipelines.layout import RunLayout
from rlpipe.pipelines.plan import Plan
from rlpipe.pipelines.preset import load_preset
from rlpipe.pipelines.runner import Pipeline
from rlpipe.schemas import read_manifest
from rlpipe.schemas.config_files import ConfigError

ITERATIONS = 4
# MINI plus what makes every optimizer step move the policy (as in test_golden.py): a format
# reward gives the groups reward variance (the micro model almost never answers correctly), a
# reference model with kl_beta > 0, and two steps per iteration (the second off-policy).
PRESET = {
    **MINI, "iterations": ITERATIONS, "eval_every": ITERATIONS, "model": {"reference": True},
    "score": {"components": [{"name": "correct", "type": "answer_match", "mode": "exact"},
                             {"name": "printable", "type": "regex_format", "pattern": "^[ -~]", "weight": 0.5}]},
    "optimize": {"lr": 1.0e-3, "micro_batch_size": 8, "minibatch_size": 8, "kl_beta": 0.04},
    "keep": KEEP_EVERYTHING,  # every iteration's policy and train state is compared (test_keep.py prunes)
}


def _preset_file(folder: Path, every: int) -> Path:
    path = folder / f"every{every}.yaml"
    path.write_text(yaml.safe_dump({**PRESET, "optimize": {**PRESET["optimize"], "state_every": every}}))
    return path


def _run(preset_file: Path, run_dir: Path) -> Path:
    Pipeline(load_preset(preset_file), run_dir, log=lambda s: None).run()
    return run_dir


def _hashes(run_dir: Path, artifact: str = "policy") -> list[str]:
    return [read_manifest(run_dir / f"iter_{k:04d}" / artifact).content_hash for k in range(ITERATIONS)]


def _replayed_runs(policy: Path) -> float:
    return read_manifest(policy).extra["timing"].get("replayed_runs", 0.0)


def _optimize(plan: Plan, k: int):
    return next(c for c in plan.iteration(k) if c.name == "optimize").config


def test_the_plan_saves_every_nth_state_and_replays_the_runs_since(tmp_path):
    plan = Plan(load_preset("grpo", ["optimize.state_every=3", "iterations=7"]), RunLayout(tmp_path))
    L = plan.layout
    got = [(c.train_state, c.replay, c.train_state_output) for c in (_optimize(plan, k) for k in range(7))]
    s, p = (lambda k: L.stage(k, "train_state")), (lambda k: L.stage(k, "policy"))
    assert got == [(None, [], None), (None, [p(0)], None), (None, [p(0), p(1)], s(2)),
                   (s(2), [], None), (s(2), [p(3)], None), (s(2), [p(3), p(4)], s(5)),
                   (s(5), [], s(6))]  # the last iteration saves its state whatever N
    # every replayed checkpoint is an input: its content hash keys the run
    assert list(_optimize(plan, 5).inputs()) == ["policy", "rollouts", "advantages", "reference", "train_state",
                                                 "replay[0]", "replay[1]"]
    # The default: every 10th iteration (and the last) where the engines stay alive (here, in this
    # process); every one where each call launches anew, which would replay every run since.
    default = Plan(load_preset("grpo", ["iterations=3"]), RunLayout(tmp_path))
    assert [(c.train_state, c.replay, c.train_state_output) for c in (_optimize(default, k) for k in range(3))] == [
        (None, [], None), (None, [p(0)], None), (None, [p(0), p(1)], s(2))]
    anew = Plan(load_preset("grpo", ["iterations=3", "launch.launcher=processes", "launch.resident=false",
                                     "launch.optimize.ranks_per_node=1"]), RunLayout(tmp_path))
    assert [(c.train_state, c.replay) for c in (_optimize(anew, k) for k in range(3))] == [
        (None, []), (s(0), []), (s(1), [])]


def test_state_every_must_be_at_least_one():
    with pytest.raises(ConfigError, match=r"key 'state_every': Input should be greater than or equal to 1 \(got 0\)"):
        load_preset("grpo", ["optimize.state_every=0"])  # (the preset's stage configs are validated on load)


@pytest.fixture(scope="module")
def every_1(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("every1")
    return _run(_preset_file(folder, 1), folder / "run")


@pytest.mark.train_state
@pytest.mark.slow
def test_saving_every_2_iterations_ends_as_saving_every_one(every_1, tmp_path):
    run = _run(_preset_file(tmp_path, 2), tmp_path / "run")
    want = _hashes(every_1)
    assert len(set(want)) == ITERATIONS  # every iteration moved the policy
    assert _hashes(run) == want
    assert _hashes(run, "metrics") == _hashes(every_1, "metrics")
    assert [k for k in range(ITERATIONS) if (run / f"iter_{k:04d}" / "train_state").exists()] == [1, 3]
    assert all((every_1 / f"iter_{k:04d}" / "train_state").exists() for k in range(ITERATIONS))
    assert [_replayed_runs(run / f"iter_{k:04d}" / "policy") for k in range(ITERATIONS)] == [0.0] * 4  # all warm


@pytest.mark.train_state
@pytest.mark.integration
@pytest.mark.slow
def test_a_killed_run_resumes_by_replaying_from_the_saved_state(every_1, tmp_path):
    from rlpipe.stages.common.cli import stage_main
    from rlpipe.stages.optimize.run import clear_warm

    preset, run = _preset_file(tmp_path, 2), tmp_path / "run"

    class Killed(Exception):
        pass

    def kill_after_iteration_2(record):
        if record.iteration == 2:
            raise Killed

    with pytest.raises(Killed):
        Pipeline(load_preset(preset), run, on_iteration=kill_after_iteration_2, log=lambda s: None).run()
    assert (run / "iter_0002" / "policy").is_dir() and not (run / "iter_0003" / "policy").exists()
    # As in a new process: no warm engine holds the state after iteration 2 (nor any other).
    clear_warm()
    _run(preset, run)
    assert _replayed_runs(run / "iter_0003" / "policy") == 1.0  # iteration 2, from iteration 1's state
    assert _hashes(run) == _hashes(every_1)

    # The stage alone, from iteration 3's saved config, after the run folder moved: the replayed
    # run's inputs are found beside its checkpoint (its manifest names the old paths).
    moved = run.rename(tmp_path / "moved")
    clear_warm()
    again = tmp_path / "again"
    assert stage_main("optimize", ["-c", str(moved / "iter_0003" / "configs" / "optimize.yaml"),
                                   f"output={again}/policy", f"metrics_output={again}/metrics",
                                   f"train_state_output={again}/state"]) == 0
    assert _replayed_runs(again / "policy") == 1.0
    assert read_manifest(again / "policy").content_hash == _hashes(every_1)[3]


# -- optimize.policy_weights: with_train_state ----------------------------------------------------
# The policies between train-state saves are hashed but not written; the next rollout takes them
# from memory. With state_every 3 over 4 iterations the states are saved by iterations 2 and 3, so
# policies 0 and 1 are unwritten (their manifests list the weights), 2 and 3 written whole.

def _in_memory_preset(folder: Path) -> Path:
    path = folder / "in_memory.yaml"
    path.write_text(yaml.safe_dump({**PRESET, "optimize": {**PRESET["optimize"], "state_every": 3,
                                                           "policy_weights": "with_train_state"}}))
    return path


def _weights(policy: Path) -> list[str]:
    return sorted(p.name for p in policy.glob("*.safetensors"))


def test_the_plan_writes_the_weights_with_the_train_state_and_for_each_evaluation(tmp_path):
    plan = Plan(load_preset("grpo", ["optimize.state_every=3", "optimize.policy_weights=with_train_state",
                                     "iterations=7", "eval_every=2"]), RunLayout(tmp_path))
    # the stage leaves a policy unwritten where it saves no state; evaluated ones (k = 1, 3, 5, 6) are written
    got = [(_optimize(plan, k).policy_weights, _optimize(plan, k).train_state_output is not None) for k in range(7)]
    assert got == [("with_train_state", False), ("every_iteration", False), ("with_train_state", True),
                   ("every_iteration", False), ("with_train_state", False), ("every_iteration", True),
                   ("every_iteration", True)]


@pytest.mark.parametrize("overrides, why", [
    (["async.staleness=1", "launch.launcher=processes", "launch.resident=true", "launch.optimize.ranks_per_node=1",
      "launch.rollout.workers=1"], "asynchronous run"),
    (["optimize.lora={r: 4}"], "LoRA"),
    (["rollout.engine=vllm"], "vllm engine in the driver's process"),
    (["launch.launcher=processes", "launch.resident=true", "launch.rollout.workers=1"],
     "unless rollout and optimize both run in the driver's process"),
    (["launch.launcher=processes", "launch.resident=true", "launch.rollout.workers=1",
      "launch.optimize.ranks_per_node=1", "launch.weight_channel=false"], "launch.weight_channel"),
])
def test_policies_held_in_memory_only_where_the_rollout_takes_them_from_memory(tmp_path, overrides, why):
    with pytest.raises(ConfigError, match=f"optimize.policy_weights: with_train_state needs .*{why}.*"
                                          "set optimize.policy_weights: every_iteration"):
        load_preset("grpo", ["optimize.policy_weights=with_train_state", *overrides])  # (a preset is planned on load)


@pytest.mark.train_state
@pytest.mark.integration
@pytest.mark.slow
def test_policies_held_in_memory_resume_to_the_same_run(every_1, tmp_path):
    """Uninterrupted, then killed after iteration 1 (both policies unwritten) and resumed as a new
    process would (no warm engine, no model in memory): every policy, rollout and metric has the
    hashes of the run that writes every policy, and only the saved iterations' weights are on disk."""
    from rlpipe.schemas import validate_artifact
    from rlpipe.schemas.errors import ArtifactError
    from rlpipe.stages.common.models import clear_cache, load_model
    from rlpipe.stages.optimize.run import clear_warm

    preset = _in_memory_preset(tmp_path)
    run = _run(preset, tmp_path / "run")
    for artifact in ("policy", "rollouts", "metrics"):
        assert _hashes(run, artifact) == _hashes(every_1, artifact), artifact
    policies = [run / f"iter_{k:04d}" / "policy" for k in range(ITERATIONS)]
    assert [_weights(p) for p in policies] == [[], [], ["model.safetensors"], ["model.safetensors"]]
    assert [read_manifest(p).not_written for p in policies] == [["model.safetensors"]] * 2 + [[]] * 2
    assert all(validate_artifact(p) == [] for p in policies)
    clear_cache()
    with pytest.raises(ArtifactError, match=r"iter_0001/policy: its weights \(model.safetensors\) were never written"):
        load_model(policies[1])
    # as a user meets it: inspect says so; a rollout rerun alone from iteration 2's config stops
    # with that message, a user's error's exit code (2), no traceback
    from typer.testing import CliRunner

    from rlpipe.pipelines.cli import app

    shown = CliRunner().invoke(app, ["inspect", str(policies[1])], env={"COLUMNS": "400"})
    assert shown.exit_code == 0 and re.search(r"not written\s+model.safetensors \(held in memory only", shown.output)
    rerun = CliRunner().invoke(app, ["stage", "rollout", "-c", str(run / "iter_0002" / "configs" / "rollout.yaml"),
                                     f"output={tmp_path / 'rerun'}"])
    assert rerun.exit_code == 2 and "were never written" in rerun.output and "Traceback" not in rerun.output, rerun.output

    class Killed(Exception):
        pass

    def kill_after_iteration_1(record):
        if record.iteration == 1:
            raise Killed

    resumed, lines = tmp_path / "resumed" / "run", []  # (named as the others: the rows record the run's name)
    with pytest.raises(Killed):
        Pipeline(load_preset(preset), resumed, on_iteration=kill_after_iteration_1, log=lambda s: None).run()
    assert not (resumed / "iter_0002" / "rollouts").exists()
    clear_warm()
    clear_cache()
    Pipeline(load_preset(preset), resumed, log=lines.append).run()
    assert any("iteration 2's policy" in line and "rerunning its optimize run" in line for line in lines)
    # the rerun replayed iteration 0's optimize run, checked against the hashes its manifest lists
    assert _replayed_runs(resumed / "iter_0001" / "policy") == 1.0
    for artifact in ("policy", "rollouts", "metrics"):
        assert _hashes(resumed, artifact) == _hashes(every_1, artifact), artifact
