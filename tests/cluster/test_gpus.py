"""Which GPUs placed stages get on the driver's machine (`rlpipe.cluster.gpus`), on the placement
plan alone (no GPU needed: the machine's GPUs are the driver's CUDA_VISIBLE_DEVICES).

Two resident groups on one GPU are refused before anything starts, naming both stages and the
GPU, unless `launch.share_gpus` names both; with enough GPUs each group gets its own, and the
processes see exactly those (numbered as the driver sees them)."""

from __future__ import annotations

import pytest
import yaml
from conftest import MINI
from typer.testing import CliRunner

from rlpipe.cluster.gpus import GpuConflict, assign_gpus
from rlpipe.cluster.placement import Launch
from rlpipe.cluster.processes import ProcessLauncher, group_processes
from rlpipe.cluster.workorders import GroupDir

ITERATIONS = {"rollout", "score", "advantage", "optimize", "evaluate"}
ONE_EACH = {"launcher": "processes", "rollout": {"gpus_per_worker": 1}, "optimize": {"gpus_per_node": 1}}


def _ids(launch: Launch) -> dict[str, tuple[int, ...] | None]:
    return {name: p.gpu_ids for name, p in launch.stages.items()}


def test_two_resident_groups_on_one_gpu_are_refused_before_anything_starts(tmp_path, monkeypatch):
    from rlpipe.pipelines.cli import app

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # a machine with one GPU
    preset = tmp_path / "one_gpu.yaml"
    preset.write_text(yaml.safe_dump({**MINI, "launch": ONE_EACH}))
    run_dir = tmp_path / "runs" / "one_gpu"
    result = CliRunner().invoke(app, ["run", str(preset), "--local", "--run-dir", str(run_dir)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.output.count("error:") == 1, result.output
    message = result.output[result.output.index("error:"):].strip()
    for text in ("rollout", "optimize", "GPU 0", "launch.share_gpus", "gpu_ids"):
        assert text in message, message
    assert not run_dir.exists()  # no set-up stage ran, no process started, no run folder made


def test_with_two_gpus_each_resident_group_gets_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # the driver's GPUs: the processes' ids are positions in it
    launcher = ProcessLauncher(Launch.model_validate(ONE_EACH), ITERATIONS)
    assert _ids(launcher.launch) == {"rollout": (0,), "optimize": (1,)}
    seen = {stage: [p.env["CUDA_VISIBLE_DEVICES"] for p in group_processes(
        stage, launcher.launch.stages[stage], GroupDir(tmp_path / stage), tmp_path)] for stage in ("rollout", "optimize")}
    assert seen == {"rollout": ["3"], "optimize": ["5"]}
    assert launcher.launch.make_room_for("optimize") == []  # nothing shares its GPU


def test_workers_take_blocks_of_the_ids_and_a_group_that_does_not_fit_beside_another_is_refused(tmp_path):
    launch = Launch.model_validate({"launcher": "processes", "rollout": {"workers": 2, "gpus_per_worker": 2},
                                    "optimize": {"ranks_per_node": 2, "gpus_per_node": 2}})
    placed = assign_gpus(launch, ITERATIONS, visible=["0", "1", "2", "3", "4", "5"])
    assert _ids(placed) == {"rollout": (0, 1, 2, 3), "optimize": (4, 5)}
    workers = group_processes("rollout", placed.stages["rollout"], GroupDir(tmp_path), tmp_path)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in workers] == ["0,1", "2,3"]
    with pytest.raises(GpuConflict, match=r"rollout and optimize would both hold GPUs 0, 1 .*has 4 GPUs"):
        assign_gpus(launch, ITERATIONS, visible=["0", "1", "2", "3"])


def test_share_gpus_lets_two_groups_take_one_gpu_by_turns():
    launch = Launch.model_validate({**ONE_EACH, "share_gpus": ["rollout", "optimize"]})
    placed = assign_gpus(launch, ITERATIONS, visible=["0"])
    assert _ids(placed) == {"rollout": (0,), "optimize": (0,)}
    assert placed.make_room_for("optimize") == ["rollout"]  # the rollout group sleeps before every optimize
    assert placed.make_room_for("rollout") == []
    # optimize training while the next rollout samples (async) cannot take turns with it
    with pytest.raises(GpuConflict, match="share_gpus: rollout and optimize cannot take GPU 0 by turns"):
        assign_gpus(launch, ITERATIONS, visible=["0"], overlapped=True)


def test_groups_that_hold_no_gpu_for_the_run_are_not_refused():
    # per-call launches run one at a time; set-up stages (sft) before any group starts
    per_call = Launch.model_validate({**ONE_EACH, "resident": False})
    assert _ids(assign_gpus(per_call, ITERATIONS, visible=["0"])) == {"rollout": (0,), "optimize": (0,)}
    setup = Launch.model_validate({**ONE_EACH, "sft": {"gpus_per_node": 1}})
    assert _ids(assign_gpus(setup, ITERATIONS, visible=["0", "1"])) == {"rollout": (0,), "optimize": (1,), "sft": (0,)}
    # slurm and kubernetes give every step or pod GPUs of its own
    slurm = Launch.model_validate({**ONE_EACH, "launcher": "slurm"})
    assert assign_gpus(slurm, ITERATIONS, visible=[]) == slurm


def test_gpu_ids_given_by_the_preset_are_kept_and_checked():
    launch = Launch.model_validate({"launcher": "processes", "rollout": {"gpus_per_worker": 1, "gpu_ids": [1]},
                                    "optimize": {"gpus_per_node": 1, "gpu_ids": [0]}})
    assert _ids(assign_gpus(launch, ITERATIONS, visible=["0", "1"])) == {"rollout": (1,), "optimize": (0,)}
    with pytest.raises(GpuConflict, match=r"launch.rollout.gpu_ids: 1 is not a GPU of this machine, which has 1"):
        assign_gpus(launch, ITERATIONS, visible=["0"])
    with pytest.raises(GpuConflict, match="launch.optimize asks for 2 GPUs, but this machine has 1"):
        assign_gpus(Launch.model_validate({"launcher": "processes", "optimize": {"gpus_per_node": 2}}), ITERATIONS,
                    visible=["0"])
    for bad, match in (({"rollout": {"workers": 2, "gpus_per_worker": 1, "gpu_ids": [0]}}, "asks for 2 GPUs"),
                       ({"rollout": {"gpus_per_worker": 2, "gpu_ids": [1, 1]}}, "distinct"),
                       ({"launcher": "slurm", "rollout": {"gpus_per_worker": 1, "gpu_ids": [0]}}, "GPUs of its own"),
                       ({"share_gpus": ["rollout", "optimize"], "rollout": {"workers": 2}}, "optimize not placed")):
        with pytest.raises(ValueError, match=match):
            Launch.model_validate({"launcher": "processes", **bad})


def test_no_gpus_asked_for_no_gpus_needed():
    cpu = Launch.model_validate({"launcher": "processes", "rollout": {"workers": 2}, "optimize": {"ranks_per_node": 2}})
    assert assign_gpus(cpu, ITERATIONS, visible=[]) == cpu  # (nor is the machine asked)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_groups_sharing_a_gpu_make_room_before_every_optimize(tmp_path, monkeypatch, launched_preset,
                                                              assert_like_in_process):
    """Rollout and optimize resident on one (pretended) GPU, shared: before every optimize call the
    rollout member runs a make-room order (here no vLLM engine is live: 'none'; on CUDA it sleeps,
    and the next rollout wakes it), and the run's artifacts are the in-process run's."""
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.pipelines.runner import Pipeline

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # (no GPU here: every process computes on the CPU)
    launch = {"launcher": "processes", "rollout": {"gpus_per_worker": 1},
              "optimize": {"ranks_per_node": 1, "gpus_per_node": 1}, "share_gpus": ["rollout", "optimize"]}
    preset = load_preset(launched_preset(tmp_path / "mini.yaml", launch), ["iterations=2"])
    run_dir = tmp_path / "runs" / "mini"
    pipeline = Pipeline(preset, run_dir, log=lambda s: None)
    assert _ids(pipeline.launcher.launch) == {"rollout": (0,), "optimize": (0,)}
    pipeline.run()
    assert_like_in_process(run_dir)
    assert pipeline.launcher.groups.started == {"rollout": 1, "optimize": 1}
    for k in ("iter_0000", "iter_0001"):
        lines = (run_dir / "logs" / k / "rollout.log").read_text().strip().splitlines()
        # the rollout's order, then (the driver waiting for its answer before optimize's) the make-room order
        assert lines[0].startswith("[rlpipe worker rollout.0] pid "), lines[:2]
        assert lines[-1] == "[rlpipe worker rollout.0] made room for training on its GPUs: none", lines[-3:]
