"""Placement in the preset and the launchers that carry it out: a 2-iteration run with rollout and
reference on 2 worker processes each and optimize on 2 torchrun ranks reproduces the in-process
run; a failed launched stage reports its exit code and log; a launched stage that is done skips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlpipe.cluster.failures import StageLaunchError, StageUserError
from rlpipe.cluster.launch import LOOPBACK
from rlpipe.cluster.logs import log_dir
from rlpipe.cluster.placement import Launch, StagePlacement
from rlpipe.cluster.processes import ProcessLauncher, local_processes
from rlpipe.cluster.srun import srun_command
from rlpipe.stages import StageCall


def test_placement_is_checked_against_the_stage_scaling():
    launch = Launch.model_validate({"launcher": "processes", "rollout": {"workers": 4},
                                    "optimize": {"ranks_per_node": 2}})
    assert launch.placement("rollout").workers == 4 and launch.placement("optimize").processes == 2
    assert launch.placement("score") is None  # not placed: runs in the driver
    assert Launch.model_validate(launch.model_dump()) == launch  # the saved preset reloads
    # local ignores placements: a cluster preset runs on a laptop with launch.launcher=local
    assert Launch.model_validate({"rollout": {"workers": 4}}).placement("rollout") is None
    for bad, match in (({"rollout": {"nodes": 2}}, "nodes do not apply to rollout: it scales by `workers`"),
                       ({"optimize": {"workers": 2}}, "workers do not apply to optimize"),
                       ({"advantage": {"workers": 2}}, "runs as one process"),
                       ({"rollot": {"workers": 2}}, "launch.rollot: neither a setting"),
                       ({"launcher": "processes", "optimize": {"nodes": 2}}, "use launcher slurm or kubernetes")):
        with pytest.raises(ValidationError, match=match):
            Launch.model_validate(bad)


def _call(tmp_path: Path, name: str) -> StageCall:
    from rlpipe.stages import stage_config

    cfgs = tmp_path / "runs" / "r" / "iter_0003" / "configs"
    paths = {"rollout": dict(checkpoint=tmp_path / "p", prompts=tmp_path / "q", output=tmp_path / "o", run="r",
                             iteration=3),
             "optimize": dict(policy=tmp_path / "p", rollouts=tmp_path / "r", advantages=tmp_path / "a",
                              output=tmp_path / "o", metrics_output=tmp_path / "m", run="r")}[name]
    return StageCall(name, stage_config(name, {}, **paths), cfgs)


def test_every_launcher_name_resolves_to_a_placed_launcher():
    """The registry names its launchers by 'module:class' strings (the prefect one lives in
    rlpipe.flows, above cluster): each name a preset may give resolves, `local` to this process."""
    from typing import get_args

    from rlpipe.cluster.inprocess import run_in_process
    from rlpipe.cluster.launchers import LAUNCHERS, launcher_for
    from rlpipe.cluster.placed import PlacedLauncher
    from rlpipe.cluster.placement import LauncherName
    from rlpipe.stages.common.cli import import_ref

    assert set(LAUNCHERS) == set(get_args(LauncherName)) - {"local"}
    assert all(issubclass(import_ref(ref), PlacedLauncher) for ref in LAUNCHERS.values())
    assert launcher_for(Launch()) is run_in_process
    assert type(launcher_for(Launch(launcher="prefect"))).__name__ == "PrefectPoolLauncher"


def test_process_and_srun_command_lines(tmp_path):
    rollout, optimize = _call(tmp_path, "rollout"), _call(tmp_path, "optimize")
    logs = log_dir(rollout)
    assert logs == tmp_path / "runs" / "r" / "logs" / "iter_0003"
    cfg = str(rollout.config_file)
    workers = local_processes(rollout, StagePlacement(workers=2), False, logs)
    assert [p.argv[1:] for p in workers] == [
        ["-m", "rlpipe.stages.rollout", "-c", cfg, f"worker_index={i}", "worker_count=2"] for i in (0, 1)]
    assert [p.log.name for p in workers] == ["rollout.0.log", "rollout.1.log"]
    assert workers[0].env["GLOO_SOCKET_IFNAME"] == "lo" and workers[0].env["DS_ACCELERATOR"] == "cpu"
    on_gpus = local_processes(rollout, StagePlacement(workers=2, gpus_per_worker=2), True, logs)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in on_gpus] == ["0,1", "2,3"] and "--force" in on_gpus[0].argv
    (ranks,) = local_processes(optimize, StagePlacement(ranks_per_node=2), False, logs)
    addr = ranks.argv.index("--master_addr")
    assert ranks.argv[0].endswith("torchrun") and ranks.argv[addr + 1] == LOOPBACK
    assert ranks.argv[ranks.argv.index("--nproc_per_node") + 1] == "2"
    assert ranks.argv[-4:] == ["-m", "rlpipe.stages.optimize", "-c", str(optimize.config_file)]

    step = srun_command(optimize, StagePlacement(nodes=2, ranks_per_node=4, gpus_per_node=4), False,
                        logs / "optimize.log", allocation_nodes=2, python="/venv/bin/python")
    assert step[:8] == ["srun", "--job-name=rlpipe-optimize", "--nodes=2", "--ntasks=8", "--ntasks-per-node=4",
                        "--cpus-per-task=1", "--gpus-per-node=4", "--kill-on-bad-exit=1"]
    assert "RANK=$SLURM_PROCID" in step[step.index("-c") + 1]
    assert step[-5:] == ["/venv/bin/python", "-m", "rlpipe.stages.optimize", "-c", str(optimize.config_file)]
    shards = srun_command(rollout, StagePlacement(workers=3), False, logs / "rollout.log", allocation_nodes=2)
    assert "--nodes=2" in shards and "--ntasks=3" in shards
    assert shards[shards.index("-c") + 1] == 'exec "$@" worker_index=$SLURM_PROCID worker_count=$SLURM_NTASKS'
    with pytest.raises(ValueError, match="the allocation has 1"):
        srun_command(optimize, StagePlacement(nodes=2), False, logs / "o.log", allocation_nodes=1)


def test_a_user_error_of_a_torchrun_rank_is_a_user_error(tmp_path, monkeypatch):
    """torchrun exits 1 whatever its rank's exit code; the rank's 2 (a user error) is read from
    torchrun's report, so the driver shows one `error:` paragraph instead of a crash. torchrun's
    own folder (its --log-dir, else a `torchelastic_*` folder it leaves in the temporary directory)
    is gone after the launch."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))  # (the launched processes' temporary directory)
    call = _call(tmp_path, "optimize")
    call.config_file.parent.mkdir(parents=True)
    call.config_file.write_text("lr: -1\n")  # the stage's own config check fails: exit 2
    launcher = ProcessLauncher(Launch(launcher="processes", resident=False,
                                      stages={"optimize": StagePlacement(ranks_per_node=1)}))
    with pytest.raises(StageUserError, match="stage optimize failed \\(exit code 2, torchrun's 1\\)") as e:
        launcher(call)
    assert e.value.exit_code == 2 and "lr" in str(e.value)
    assert list(tmpdir.iterdir()) == [] and [p.name for p in e.value.log.parent.iterdir()] == ["optimize.log"]


@pytest.mark.parametrize("resident", [True, False], ids=["resident", "per_call"])
def test_a_failed_launched_stage_reports_its_exit_code_and_log(tmp_path, resident):
    call = _call(tmp_path, "rollout")
    call.config_file.parent.mkdir(parents=True)
    call.config_file.write_text("group_size: -1\n")  # the stage's own config check fails: exit 2
    # an earlier attempt's worker marked itself done: a launch of every worker forgets it first
    # (tests/schemas/test_manifest.py::test_a_launch_counts_only_its_own_workers_markers)
    earlier = tmp_path / ".o.staging" / f".worker-1-of-2.{'k' * 16}.done"
    earlier.parent.mkdir()
    earlier.touch()
    launcher = ProcessLauncher(Launch(launcher="processes", resident=resident,
                                      stages={"rollout": StagePlacement(workers=2)}))
    with pytest.raises(StageLaunchError, match="stage rollout failed \\(exit code 2\\)") as e:
        launcher(call)
    assert not earlier.exists() and earlier.parent.is_dir()
    assert launcher.groups.groups == {} and launcher.groups.started == ({"rollout": 1} if resident else {})
    log = tmp_path / "runs" / "r" / "logs" / "iter_0003" / "rollout.0.log"
    assert e.value.exit_code == 2 and e.value.log in (log, log.with_name("rollout.1.log"))
    # the worker that failed first is reported; the other is stopped
    assert "group_size" in str(e.value) and "error:" in e.value.log.read_text()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_processes_launcher_reproduces_the_in_process_run(tmp_path, launched_preset, assert_like_in_process):
    """One launch per call (`resident: false`); tests/cluster/test_resident.py runs resident groups."""
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.pipelines.runner import Pipeline
    from rlpipe.schemas import read_manifest

    preset = load_preset(launched_preset(tmp_path / "mini.yaml", {"launcher": "processes", "resident": False,
                                                                   "rollout": {"workers": 2},
                                                                   "reference": {"workers": 2},
                                                                   "optimize": {"nodes": 1, "ranks_per_node": 2}}))
    run_dir = tmp_path / "runs" / "mini"
    pipeline = Pipeline(preset, run_dir, log=lambda s: None)
    pipeline.run()
    assert_like_in_process(run_dir)
    logs = run_dir / "logs" / "iter_0001"
    assert sorted(p.name for p in logs.iterdir()) == [
        "optimize.log", "reference.0.log", "reference.1.log", "rollout.0.log", "rollout.1.log"]
    # the 2 workers wrote one artifact: 4 groups x 4 samples, each row once
    assert read_manifest(run_dir / "iter_0001" / "rollouts").rows == 16
    # resume: a launched stage whose manifest matches skips itself (its manifest is not rewritten)
    before = (run_dir / "iter_0001" / "rollouts" / "_manifest.json").read_text()
    (rollout,) = [c for c in pipeline.plan.iteration(1) if c.name == "rollout"]
    pipeline.call(rollout)
    assert (run_dir / "iter_0001" / "rollouts" / "_manifest.json").read_text() == before
    assert json.loads(before)["content_hash"]
