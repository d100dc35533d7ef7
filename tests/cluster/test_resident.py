"""Resident worker groups (`launch.resident`, the default): each placed stage of the iterations
starts once for the run and takes every iteration's call as a work order.

- 3 iterations with rollout and reference on 2 resident workers and optimize on a resident
  2-rank torchrun job reproduce the in-process run; each group started once (one pid per member
  across the iterations); no process left when the run ends.
- Faults, one chain on one run directory driven by `rlpipe run` as a user runs it: a worker alive
  but silent past `launch.stall_timeout_s` is reported stuck; an optimize rank SIGKILLed fails
  the run within seconds as the machine's failure (exit code 3, one paragraph naming the rank and
  its log; optimize is not retried); the driver SIGKILLed between work orders and
  interrupted with Ctrl-C take their workers with them; the same command then finishes with the
  content hashes of an uninterrupted run.
- A score worker SIGKILLed mid-order is retried once and the run finishes as an uninterrupted
  run; lost again in the retry, the run ends as the machine's failure.
- The weight channel: the rollout members take each new policy from it (in the first test), and
  a run killed around it (the sender after sending, a member mid-receive) resumes identically.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from launched import LAUNCHED, PLACEMENT, assert_like_reference

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TESTS = Path(__file__).resolve().parents[1]


def worker_pids(run_dir: Path) -> list[int]:
    """Live processes of the run's resident groups (workers and torchrun agents)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "rlpipe.cluster.worker" in cmdline and str(run_dir) in cmdline:
            found.append(int(proc.name))
    return found


def wait_for(what, timeout: float, poll: float = 0.1, driver: Driver | None = None):
    """what()'s first true value within `timeout` s (while `driver`, if given, still runs)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        if driver is not None and driver.proc.poll() is not None:
            raise AssertionError(f"the driver ended (exit {driver.proc.returncode}) before "
                                 f"{what.__doc__ or what}:\n{driver.output[-3000:]}")
        time.sleep(poll)
    raise AssertionError(f"not within {timeout} s: {what.__doc__ or what}")


def order_pids(run_dir: Path, stage: str) -> dict[str, set[int]]:
    """Member -> the pids that ran its orders, from the order logs of every iteration."""
    pids: dict[str, set[int]] = {}
    for log in sorted(run_dir.glob(f"logs/iter_*/{stage}*.log")):
        for member, pid in re.findall(rf"\[rlpipe worker {stage}\.(\d+)\] pid (\d+):", log.read_text()):
            pids.setdefault(member, set()).add(int(pid))
    return pids


def test_resident_groups_reproduce_the_in_process_run_and_start_once(tmp_path, launched_preset,
                                                                     assert_like_in_process):
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.pipelines.runner import Pipeline

    preset = load_preset(launched_preset(tmp_path / "mini.yaml", {"launcher": "processes", **PLACEMENT}),
                         ["iterations=3"])
    assert preset.launch.resident
    run_dir = tmp_path / "runs" / "mini"
    pipeline = Pipeline(preset, run_dir, log=lambda s: None)
    pipeline.run()
    assert_like_in_process(run_dir)
    # from iteration 1 on the 2 rollout members took the policy over the weight channel (the files,
    # checked against their hashes, copied in place): rollouts as the in-process run's, bit for bit
    loads = [json.loads((run_dir / f"iter_{k:04d}" / "rollouts" / "_manifest.json").read_text())["extra"]["timing"]
             ["model_load"] for k in range(3)]
    assert loads == ["loaded", "channel", "channel"]
    sent = [line for k in range(3) for line in (run_dir / "logs" / f"iter_{k:04d}" / "optimize.log").read_text().splitlines()
            if line.startswith("[rlpipe weight channel]")]
    assert len(sent) == 3 and all(" to 2 member(s) in " in line for line in sent), sent
    assert pipeline.launcher.groups.started == {"rollout": 1, "reference": 1, "optimize": 1}
    for stage, members in (("rollout", 2), ("reference", 2), ("optimize", 2)):
        pids = order_pids(run_dir, stage)
        # every member ran the orders of all 3 iterations in one process
        assert sorted(pids) == [str(m) for m in range(members)] and all(len(p) == 1 for p in pids.values()), pids
        assert sum(len(re.findall(rf"\[rlpipe worker {stage}\.0\] pid", p.read_text()))
                   for p in run_dir.glob(f"logs/iter_*/{stage}*.log")) == 3
    assert worker_pids(run_dir) == [] and not (run_dir / "workers").exists()
    # the per-iteration logs are where a per-call launch writes them
    assert sorted(p.name for p in (run_dir / "logs" / "iter_0002").iterdir()) == [
        "optimize.log", "reference.0.log", "reference.1.log", "rollout.0.log", "rollout.1.log"]


# -- faults ---------------------------------------------------------------------------------------
#: LAUNCHED with a `python` reward component that can hold a worker (tests/resident_hooks.py),
#: rollout on a resident worker, score on 2, optimize on 2 ranks.
FAULTS = {
    **LAUNCHED,
    "eval_every": 0,
    "score": {"components": [*LAUNCHED["score"]["components"],
                             {"name": "parity", "type": "python", "function": "resident_hooks:parity"}]},
    "launch": {"launcher": "processes", "rollout": {"workers": 1}, "score": {"workers": 2},
               "optimize": {"ranks_per_node": 2}},
}


class Driver:
    """`rlpipe run <preset> --local` in its own process, as a user runs it."""

    def __init__(self, root: Path, preset: Path, *overrides: str, env: dict[str, str] | None = None):
        root.mkdir(exist_ok=True)
        self.run_dir = root / "runs" / "mini"
        self.out = root / f"driver-{time.monotonic_ns()}.log"
        cmd = [sys.executable, "-m", "rlpipe.pipelines.cli", "run", str(preset), "--local", "--run-dir",
               str(self.run_dir), "iterations=3", *overrides]
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS), **(env or {})}
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=root, env=full_env, stdout=out, stderr=subprocess.STDOUT)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"the driver did not end within {timeout} s:\n{self.output}") from None

    @property
    def output(self) -> str:
        return self.out.read_text(errors="replace")


def _no_workers_within(run_dir: Path, seconds: float) -> None:
    def gone() -> bool:
        """every worker process of the run has ended"""
        return not worker_pids(run_dir)

    wait_for(gone, seconds)


def _hashes(run_dir: Path) -> dict[str, str]:
    import json

    return {str(m.parent.relative_to(run_dir)): json.loads(m.read_text())["content_hash"]
            for m in sorted(run_dir.glob("iter_*/*/_manifest.json"))
            if m.parent.name in ("rollouts", "scores", "reference", "advantages")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """runs/mini of FAULTS run in this process (launcher local), 3 iterations: the uninterrupted run
    every fault test's resumed run is compared with. One for the module: the runs differ from it
    in placement only (CHANNEL's 2 rollout members, optimize's ranks), which no artifact's content
    depends on, and the comparisons only read it."""
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.pipelines.runner import Pipeline

    root = tmp_path_factory.mktemp("faults_reference")
    preset = root / "faults.yaml"
    preset.write_text(yaml.safe_dump(FAULTS))
    run_dir = root / "runs" / "mini"
    Pipeline(load_preset(preset, ["iterations=3", "launch.launcher=local"]), run_dir, log=lambda s: None).run()
    return run_dir


def _resident(tmp_path: Path, spec: dict) -> tuple[Path, Path, Path]:
    """`spec` written as a preset file, and the root and run folder of the resident runs."""
    preset = tmp_path / "preset.yaml"
    preset.write_text(yaml.safe_dump(spec))
    root = tmp_path / "resident"
    return preset, root, root / "runs" / "mini"


def test_faults_fail_fast_take_the_workers_along_and_resume_identically(tmp_path, reference):
    preset, root, run_dir = _resident(tmp_path, FAULTS)

    # 1. a worker alive but silent: reported stuck after the stall timeout, its group stopped.
    # Only score is placed here (a placement is no part of the run: the same run directory), so
    # that no other group's silent first steps (loading a model on a loaded machine) meet the
    # short timeout first.
    only_score = tmp_path / "only-score.yaml"
    only_score.write_text(yaml.safe_dump({**FAULTS, "launch": {"launcher": "processes", "score": {"workers": 2}}}))
    hold = tmp_path / "hold-1"
    d = Driver(root, only_score, "launch.stall_timeout_s=5", env={"RLPIPE_TEST_HOLD": str(hold)})
    wait_for(hold.is_file, 300, driver=d)
    assert d.wait(60) != 0
    assert "stage score failed" in d.output and "wrote nothing for 5 s (launch.stall_timeout_s)" in d.output
    _no_workers_within(run_dir, 15)

    # 2. an optimize rank SIGKILLed during iteration 1: torchrun ends the job; optimize is not
    # retried (its registry entry: retries 0), so the run ends as the machine's failure: one
    # paragraph naming the rank and its log, exit code 3 (a retried stage:
    # test_a_lost_worker_is_a_machine_failure_retried_once)
    d = Driver(root, preset)
    log = run_dir / "logs" / "iter_0001" / "optimize.log"

    def rank_1() -> int | None:
        """rank 1 took iteration 1's optimize order"""
        found = re.search(r"\[rlpipe worker optimize\.1\] pid (\d+):", log.read_text()) if log.is_file() else None
        return int(found.group(1)) if found else None

    rank = wait_for(rank_1, 300, poll=0.01, driver=d)
    os.kill(rank, signal.SIGKILL)
    killed = time.monotonic()
    assert d.wait(90) == 3, d.output
    assert time.monotonic() - killed < 30, "the failure took too long to surface"
    assert "Traceback" not in d.output and d.output.count("error:") == 1, d.output
    message = d.output[d.output.index("error:"):]
    assert message.startswith(f"error: stage optimize: worker optimize.1 (pid {rank}) was lost ("), message
    assert f"its log: {log}." in message and "rerun the same command to resume" in message
    _no_workers_within(run_dir, 15)

    # 3. the driver SIGKILLed between work orders: its workers see it gone and leave
    d = Driver(root, preset)
    wait_for((run_dir / "iter_0001" / "policy" / "_manifest.json").is_file, 300, poll=0.01, driver=d)
    assert worker_pids(run_dir), "the resident workers should be running"
    d.proc.kill()
    d.wait(10)
    _no_workers_within(run_dir, 15)

    # 4. Ctrl-C: the driver stops its groups and exits 130. (The killed driver's members may have
    # begun iteration 2's rollout already, the policy taken over the weight channel before its
    # manifest was on disk: its log goes, so only this driver's order can be waited for.)
    shutil.rmtree(run_dir / "logs" / "iter_0002", ignore_errors=True)
    d = Driver(root, preset)
    wait_for(lambda: any("[rlpipe worker rollout.0]" in p.read_text() for p in run_dir.glob("logs/iter_0002/rollout.log")),
             300, poll=0.01, driver=d)
    d.proc.send_signal(signal.SIGINT)
    assert d.wait(60) == 130, d.output
    _no_workers_within(run_dir, 15)

    # 5. the same command finishes the run: what an uninterrupted run computes
    d = Driver(root, preset)
    assert d.wait(600) == 0, d.output
    assert _hashes(run_dir) == _hashes(reference) and len(_hashes(run_dir)) == 3 * 4
    assert_like_reference(run_dir, reference)
    assert worker_pids(run_dir) == [] and not (run_dir / "workers").exists()


def _held(hold: Path, driver: Driver, timeout: float = 300) -> int:
    """The pid of the worker that holds (tests/resident_hooks.py), once one does."""

    def holder() -> int | None:
        """a score worker holds mid-order"""
        text = hold.read_text() if hold.is_file() else ""
        return int(text) if text else None

    return wait_for(holder, timeout, driver=driver)


def _member(run_dir: Path, pid: int) -> str:
    """Which score member the process `pid` was, from its order logs."""
    for log in run_dir.glob("logs/iter_*/score.*.log"):
        found = re.search(rf"\[rlpipe worker (score\.\d)\] pid {pid}:", log.read_text())
        if found:
            return found.group(1)
    raise AssertionError(f"no order log names pid {pid}")


def test_a_lost_worker_is_a_machine_failure_retried_once(tmp_path, reference):
    """A score worker SIGKILLed mid-order: the call is retried once on a fresh group (the stage
    registry's `retries`, as the Prefect flow retries it), and the run finishes with the content
    of an uninterrupted run. Lost again in the retry, the run ends in one `error:` paragraph
    naming the stage, the member and its log, exit code 3, no traceback; the same command then
    resumes. torchrun's folders are not left in the temporary directory."""
    preset = tmp_path / "faults.yaml"
    preset.write_text(yaml.safe_dump(FAULTS))
    root, tmpdir, hold = tmp_path / "resident", tmp_path / "tmp", tmp_path / "hold"
    tmpdir.mkdir()
    run_dir = root / "runs" / "mini"
    env = {"RLPIPE_TEST_HOLD": str(hold), "TMPDIR": str(tmpdir)}

    # 1. lost, then lost again in the retry: the run ends as the machine's failure
    d = Driver(root, preset, env=env)
    first = _held(hold, d)
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: "retrying score (1/1), a worker was lost: " in d.output, 60, driver=d)
    hold.unlink()  # (the failed group is gone: the retried group's first call holds)
    second = _held(hold, d)
    assert second != first
    os.kill(second, signal.SIGKILL)
    killed = time.monotonic()
    assert d.wait(60) == 3, d.output
    assert time.monotonic() - killed < 15, "the failure took too long to surface"
    member = _member(run_dir, second)
    assert "Traceback" not in d.output and d.output.count("error:") == 1, d.output
    message = d.output[d.output.index("error:"):].strip()
    assert message == (f"error: stage score: worker {member} (pid {second}) was lost (killed by SIGKILL: the OOM "
                       f"killer, a preemption or a lost node?); its log: {run_dir}/logs/iter_0000/{member}.log. This "
                       "is the machine's failure, not a problem with the run: what was complete is kept, rerun the "
                       "same command to resume"), message
    _no_workers_within(run_dir, 15)

    # 2. the same command, lost once: retried, the run finishes as an uninterrupted run does
    hold.unlink()
    d = Driver(root, preset, env=env)
    os.kill(_held(hold, d), signal.SIGKILL)
    assert d.wait(600) == 0, d.output
    assert d.output.count("retrying score (1/1), a worker was lost: stage score: worker score.") == 1, d.output
    assert _hashes(run_dir) == _hashes(reference) and len(_hashes(run_dir)) == 3 * 4
    assert_like_reference(run_dir, reference)
    assert worker_pids(run_dir) == [] and not (run_dir / "workers").exists()
    assert list(tmpdir.iterdir()) == []


# -- the weight channel ---------------------------------------------------------------------------
# Faults around the weight channel (stages/common/weight_channel.py), rollout on 2 members and
# optimize on 2 ranks, each segment killed where the channel is exposed; the same command then
# finishes the run with the content hashes of an uninterrupted in-process run:
# 1. optimize's rank 0 SIGKILLed after it sent policy 1 to the rollout members and before that
#    policy's manifest is on disk (its background write paused): the run fails as the machine's
#    failure (exit 3), no policy 1 is visible;
# 2. a rollout member SIGKILLed mid-receive (the header taken, the files not): the rollout group is
#    started anew (rollout is retried once), its members read the policy's file and say so in
#    one log line each.
HOOKS = Path(__file__).parent / "worker_hooks"

#: FAULTS with 2 rollout members: the channel broadcasts to two receivers.
CHANNEL = {**FAULTS, "launch": {**FAULTS["launch"], "rollout": {"workers": 2}}}


def _paused(point: str, pause_file: Path) -> dict[str, str]:
    """The environment that pauses `point` ('module:attr@N') in the run's workers (worker_hooks)."""
    return {"PYTHONPATH": f"{TESTS}{os.pathsep}{HOOKS}", "RLPIPE_TEST_WORKER_PAUSE": point,
            "RLPIPE_TEST_WORKER_PAUSE_FILE": str(pause_file)}


def test_killed_around_the_hand_over_a_run_resumes_to_the_same_hashes(tmp_path, reference):
    preset, root, run_dir = _resident(tmp_path, CHANNEL)

    # 1. the sender killed after sending policy 1, before its manifest (its 2nd background write)
    pause = tmp_path / "paused-1"
    d = Driver(root, preset, env=_paused("rlpipe.stages.common.handoff:write_manifest@2", pause))
    sender = _held(pause, d)
    sent = (run_dir / "logs" / "iter_0001" / "optimize.log").read_text()
    assert "[rlpipe weight channel] sent policy" in sent and " to 2 member(s) " in sent
    os.kill(sender, signal.SIGKILL)
    assert d.wait(120) == 3, d.output
    assert "Traceback" not in d.output and d.output.count("error:") == 1, d.output
    assert not (run_dir / "iter_0001" / "policy" / "_manifest.json").exists()
    _no_workers_within(run_dir, 15)

    # 2. a rollout member killed mid-receive (its first hand-off of this segment: policy 1, sent again)
    pause = tmp_path / "paused-2"
    d = Driver(root, preset, env=_paused("rlpipe.stages.common.weight_receiver:receive_files@1", pause))
    member = _held(pause, d)
    os.kill(member, signal.SIGKILL)
    assert d.wait(600) == 0, d.output
    assert "retrying rollout (1/1), a worker was lost" in d.output, d.output
    read = [line for p in run_dir.glob("logs/iter_0002/rollout.*.log") for line in p.read_text().splitlines()
            if "did not come over the weight channel" in line]
    assert len(read) == 2, read  # one line per member of the new group, which read the file

    # every artifact as the uninterrupted in-process run's
    assert _hashes(run_dir) == _hashes(reference) and len(_hashes(run_dir)) == 3 * 4
    assert_like_reference(run_dir, reference)
    assert worker_pids(run_dir) == [] and not (run_dir / "workers").exists()

    # 3. in one process: the whole run killed while its background thread writes policy 1
    local = tmp_path / "local"
    pause = tmp_path / "paused-3"
    d = Driver(local, preset, "launch.launcher=local", env=_paused("rlpipe.stages.common.handoff:write_manifest@2",
                                                                    pause))
    assert _held(pause, d) == d.proc.pid  # (the driver's own background writer holds)
    os.kill(d.proc.pid, signal.SIGKILL)
    d.wait(60)
    assert not (local / "runs" / "mini" / "iter_0001" / "policy" / "_manifest.json").exists()
    again = Driver(local, preset, "launch.launcher=local")
    assert again.wait(600) == 0, again.output
    assert _hashes(local / "runs" / "mini") == _hashes(reference)
    assert_like_reference(local / "runs" / "mini", reference)

    # 4. the resident optimize's background write of policy 1 fails (a full disk): the driver stops with
    # that cause alone, whether it finds it waiting for the policy or in optimize's next order (which
    # fails on it), and the same command then resumes
    failing = root / "full"
    d = Driver(failing, preset, env={"PYTHONPATH": f"{TESTS}{os.pathsep}{HOOKS}",
                                     "RLPIPE_TEST_WORKER_FAIL": "rlpipe.stages.common.handoff:write_manifest@2"})
    assert d.wait(300) == 2, d.output
    assert "Traceback" not in d.output and d.output.count("error:") == 1, d.output
    assert "optimize worker 0 could not finish writing" in d.output and "No space left on device" in d.output
    again = Driver(failing, preset)
    assert again.wait(600) == 0, again.output
    assert _hashes(failing / "runs" / "mini") == _hashes(reference)


# `optimize.policy_weights: with_train_state` on the channel run: policies 0 and 1 are sent, never
# written (the state is saved by iteration 2 alone). A member SIGKILLed mid-receive of policy 0:
# the rollout is retried on a new group, which holds no policy; the driver first reruns optimize 0
# (no receiver is live, so it writes the weights), the new members read them, and the run ends as
# the uninterrupted in-process run that writes every policy.
def test_a_policy_held_in_memory_only_is_recomputed_for_a_new_rollout_group(tmp_path, reference):
    preset, root, run_dir = _resident(tmp_path, CHANNEL)
    pause = tmp_path / "paused"
    d = Driver(root, preset, "optimize.state_every=3", "optimize.policy_weights=with_train_state",
               env=_paused("rlpipe.stages.common.weight_receiver:receive_files@1", pause))
    member = _held(pause, d)
    wait_for((run_dir / "iter_0000" / "policy" / "_manifest.json").is_file, 60, driver=d)
    assert read_manifest_json(run_dir / "iter_0000" / "policy")["not_written"] == ["model.safetensors"]
    os.kill(member, signal.SIGKILL)
    assert d.wait(600) == 0, d.output
    assert "retrying rollout (1/1), a worker was lost" in d.output, d.output
    assert "iteration 1's policy" in d.output and "rerunning its optimize run" in d.output, d.output
    assert _hashes(run_dir) == _hashes(reference) and len(_hashes(run_dir)) == 3 * 4
    assert_like_reference(run_dir, reference)
    policies = [read_manifest_json(run_dir / f"iter_{k:04d}" / "policy") for k in range(3)]
    assert [p.get("not_written", []) for p in policies] == [[], ["model.safetensors"], []]
    assert [(run_dir / f"iter_{k:04d}" / "policy" / "model.safetensors").is_file() for k in range(3)] == [True, False, True]
    loads = [read_manifest_json(run_dir / f"iter_{k:04d}" / "rollouts")["extra"]["timing"]["model_load"] for k in range(3)]
    assert loads == ["loaded", "loaded", "channel"]  # (iteration 1's new group read policy 0's rewritten files)


def read_manifest_json(artifact: Path) -> dict:
    return json.loads((artifact / "_manifest.json").read_text())
