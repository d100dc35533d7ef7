"""Machine failures and resident groups that come and go (rlpipe.cluster.failures, .resident,
.worker, .kubernetes): the fast cases, on real worker processes where a process matters.

- An exit code picks the error: a signal (-9, 137, a torchrun rank's -9) is a lost worker (one
  `error:` paragraph naming the stage, the member and its log; exit code 3), 2 a user error, 1 a bug.
- A member lost mid-order while its peer answered with the failure it caused (a collective or a
  shared save whose rank died) is reported as the loss, not as the peer's user error.
- A member killed mid-order and started again goes on from the first order it has not answered.
- A stopped group's members are gone before `stop` returns; a new group of the stage never starts
  while an old member still beats.
- Kubernetes: a failed pod's exit code and index name the member; stopping a group waits for the
  pods' deletion.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from rlpipe.cluster.failures import StageLaunchError, StageUserError, WorkerLost
from rlpipe.cluster.resident import ResidentGroup
from rlpipe.cluster.workorders import GroupDir, process_start, this_process
from rlpipe.schemas.errors import EXIT_MACHINE, MachineError
from rlpipe.stages.common.cli import report_failure

HOOKS = Path(__file__).parent / "worker_hooks"

#: The end of torchrun's report when rank 1 of 2 was SIGKILLed (torch 2.13, abridged).
TORCHRUN_REPORT = """\
Root Cause (first observed failure):
[0]:
  time      : 2026-11-25_10:30:15
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4242)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
=======================================================
"""


def test_the_exit_code_picks_the_error(tmp_path, capsys):
    log = tmp_path / "score.1.log"
    log.write_text("[rlpipe worker score.1] pid 99: -c score.yaml\n")
    lost = StageLaunchError("score", -9, log, member=1, pid=99)
    assert type(lost) is WorkerLost and isinstance(lost, MachineError)
    assert str(lost) == (f"stage score: worker score.1 (pid 99) was lost (killed by SIGKILL: the OOM killer, a "
                         f"preemption or a lost node?); its log: {log}. This is the machine's failure, not a problem "
                         "with the run: what was complete is kept, rerun the same command to resume")
    assert type(StageLaunchError("score", 137, log)) is WorkerLost  # a shell's or Kubernetes' 128 + 9
    assert type(StageLaunchError("score", 2, log)) is StageUserError
    assert type(StageLaunchError("score", 1, log)) is StageLaunchError
    # torchrun exits 1; its report names the rank that was killed
    torchrun = tmp_path / "optimize.log"
    torchrun.write_text(TORCHRUN_REPORT)
    rank = StageLaunchError("optimize", 1, torchrun)
    assert type(rank) is WorkerLost and "worker optimize.1 (pid 4242) was lost (killed by SIGKILL" in str(rank)
    again = pickle.loads(pickle.dumps(lost))  # (a Prefect task's failure travels pickled)
    assert type(again) is WorkerLost and str(again) == str(lost)

    # the command line's report: one paragraph, no traceback, exit code 3 (the traceback with --debug)
    said: list[str] = []
    assert report_failure(lost, False, said.append) == EXIT_MACHINE == 3
    assert said == [str(lost)] and capsys.readouterr().err == ""
    assert report_failure(lost, True, said.append) == 3
    assert "rlpipe.cluster.failures.WorkerLost: stage score" in capsys.readouterr().err


class Handle:
    """A group's processes that all still run (the members are records in the group folder)."""

    logs: list[Path] = []

    def __init__(self):
        self.stopped = False

    def ended(self):
        return None

    def stop(self, grace):
        self.stopped = True


def _dead_process() -> dict:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    record = {**this_process(), "pid": proc.pid, "start": process_start(proc.pid)}
    proc.wait()
    return record


def test_a_peer_lost_mid_order_is_the_cause_of_the_failure(tmp_path):
    """Rank 1 killed during the train state's save; rank 0 then fails on what was to be saved
    with it (here a user error, 2): the call fails as rank 1's loss, retried as a machine failure."""
    group = GroupDir.create(tmp_path, "optimize", 2, driver_timeout_s=60)
    out = {0: tmp_path / "optimize.log", 1: tmp_path / "optimize.log"}
    resident = ResidentGroup("optimize", group, 2, Handle(), stall_timeout_s=60)
    resident.seq = 1
    group.member_started(0, this_process())
    group.answer(1, 0, {"exit_code": 2, "pid": os.getpid(), "seconds": 0.1})
    group.member_started(1, this_process())  # alive: rank 0's own error is the cause
    with pytest.raises(StageUserError):
        resident._wait(out)
    dead = _dead_process()
    group.member_started(1, dead)  # gone without an answer or an exit: lost
    with pytest.raises(WorkerLost, match=f"worker optimize.1 \\(pid {dead['pid']}\\) was lost"):
        resident._wait(out)
    # an exit by a signal (the peers torchrun ends after a rank failed) is not taken for the cause
    group.answer(1, 1, {"exit_code": -15, "pid": dead["pid"], "seconds": 0.1})
    group.answer(1, 0, {"exit_code": 143, "pid": os.getpid(), "seconds": 0.1})
    group.answer(1, 1, {"exit_code": 2, "pid": dead["pid"], "seconds": 0.1})
    with pytest.raises(StageUserError) as e:
        resident._wait(out)
    assert e.value.member == 1


# -- real members ------------------------------------------------------------------------------
def _worker(group: GroupDir, log: Path, pause: str | None = None, pause_file: Path | None = None) -> subprocess.Popen:
    """`python -m rlpipe.cluster.worker` as member 0 of 1 (with a pause: tests/cluster/worker_hooks)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HOOKS), os.environ.get("PYTHONPATH", "")])}
    if pause:
        env |= {"RLPIPE_TEST_WORKER_PAUSE": pause, "RLPIPE_TEST_WORKER_PAUSE_FILE": str(pause_file)}
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "rlpipe.cluster.worker", "--group", str(group.path),
                                 "--member", "0", "--members", "1"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _order(group: GroupDir, seq: int, folder: Path) -> Path:
    """Order `seq`: the task stage (a few prompts: a fraction of a second), its own outputs."""
    config = folder / f"task-{seq}.yaml"
    config.write_text(yaml.safe_dump({"train": str(folder / f"train-{seq}"), "heldout": str(folder / f"heldout-{seq}"),
                                      "n_train": 4, "n_heldout": 2}))
    log = folder / f"order-{seq}.log"
    group.send(seq, {"config_file": str(config), "force": False, "logs": {"0": str(log)}})
    return log


def _answer(group: GroupDir, seq: int, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while not (answers := group.answers(seq, 1)):
        assert time.monotonic() < deadline, f"order {seq} not answered within {timeout} s"
        time.sleep(0.05)
    return answers[0]


def _until(what, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (value := what()):
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)
    return value


def test_a_restarted_member_answers_only_new_orders(tmp_path):
    group = GroupDir.create(tmp_path, "task", 1, driver_timeout_s=60)
    own_log, paused = tmp_path / "worker.log", tmp_path / "paused"
    first = _worker(group, own_log, "rlpipe.stages.task.run:run@3", paused)  # holds mid-order 3
    logs = [_order(group, seq, tmp_path) for seq in (1, 2, 3)]
    assert [_answer(group, seq)["exit_code"] for seq in (1, 2)] == [0, 0]
    before = [log.read_text() for log in logs[:2]]
    assert int(_until(lambda: paused.is_file() and paused.read_text())) == first.pid
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert group.answers(3, 1) == {}  # killed mid-order 3

    second = _worker(group, own_log)  # its scheduler starts it again (a pod, a task)
    try:
        assert _answer(group, 3) == {"exit_code": 0, "pid": second.pid, "seconds": pytest.approx(0, abs=60)}
        _order(group, 4, tmp_path)
        assert _answer(group, 4)["pid"] == second.pid
        # orders 1 and 2 were not run again: their answers and logs are the first process's
        assert [_answer(group, seq)["pid"] for seq in (1, 2)] == [first.pid, first.pid]
        assert [log.read_text() for log in logs[:2]] == before
        assert f"[rlpipe worker task.0] pid {second.pid}: -c" in logs[2].read_text()
        assert "[rlpipe worker task.0] restarted: going on from order 3" in own_log.read_text()
        group.send(5, {"stop": True})
        assert second.wait(60) == 0
    finally:
        second.kill()


def test_a_stopped_group_is_gone_before_stop_returns(tmp_path):
    """A member that cannot take the stop order (busy mid-order; a torchrun rank whose agent was
    killed, a pod still terminating: its handle's stop leaves it running) is told to leave and
    waited for: when `stop` returns no member runs, and the group folder is gone."""
    group = GroupDir.create(tmp_path, "task", 1, driver_timeout_s=60)
    paused = tmp_path / "paused"
    worker = _worker(group, tmp_path / "worker.log", "rlpipe.stages.task.run:run@1", paused)
    try:
        _order(group, 1, tmp_path)
        _until(lambda: paused.is_file() and paused.read_text())
        resident = ResidentGroup("task", group, 1, Handle(), stall_timeout_s=60)
        resident.seq = 1
        started = time.monotonic()
        resident.stop(grace=0.5)
        assert resident.gone and not group.path.exists()
        assert time.monotonic() - started < 20
        # it had left when stop returned (its exit record, written last: nothing more of it writes);
        # its interpreter may still be shutting down for a moment
        assert worker.wait(10) is not None
    finally:
        worker.kill()


def test_a_new_group_waits_until_the_old_members_are_gone(tmp_path, monkeypatch):
    """A retry after a failed call (or the same command rerun) starts a stage's group only once
    the failed group's members have gone; one still beating refuses the start as a machine failure."""
    from rlpipe.cluster import resident, resident_groups
    from rlpipe.cluster.placement import Launch, StagePlacement
    from rlpipe.stages import StageCall

    for module in (resident, resident_groups):  # (a group's stop; the run's start of a new group)
        monkeypatch.setattr(module, "ABANDON_WAIT_S", 1.0)
    monkeypatch.setattr("rlpipe.cluster.workorders.ABANDON_WAIT_S", 1.0)  # (an earlier driver's groups: `sweep`)
    old = GroupDir.create(tmp_path, "task", 1, driver_timeout_s=60)
    old.member_started(0, this_process())  # this process: alive, and beating below
    beating = threading.Event()
    beating.set()

    def beat() -> None:
        count = 0
        while beating.is_set():
            count += 1
            old.beat(count, 0)
            time.sleep(0.1)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    started: list[str] = []
    groups = resident_groups.ResidentGroups(Launch(launcher="processes"),
                                   lambda stage, p, group, members, logs: started.append(stage) or Handle())
    failed = ResidentGroup("task", old, 1, Handle(), stall_timeout_s=60)
    failed.stop(grace=0.1)
    assert not failed.gone and old.abandoned  # told to leave; it still beats
    groups._leaving["task"] = failed
    call = StageCall("task", None, tmp_path / "iter_0000" / "configs")
    with pytest.raises(MachineError, match=f"pid {os.getpid()} on .* still run after being told to leave"):
        groups._start(call, StagePlacement(), tmp_path / "logs")
    assert started == []
    beating.clear()
    thread.join()
    old.member_exited(0)  # it left
    groups._start(call, StagePlacement(), tmp_path / "logs")
    assert started == ["task"] and not old.path.exists()


def test_a_member_lost_in_its_last_background_save_fails_the_end_of_the_run(tmp_path):
    """At the stop order a member finishes what it writes in the background (the run's last train
    state); killed there, it never answers: the run's end fails as the machine's failure instead of
    a success without that train state."""
    from rlpipe.cluster.placement import Launch
    from rlpipe.cluster.process_group import Process, ProcessGroup
    from rlpipe.cluster.resident_groups import ResidentGroups

    group = GroupDir.create(tmp_path, "task", 1, driver_timeout_s=60)
    paused = tmp_path / "paused"
    env = {**os.environ, "PYTHONPATH": str(HOOKS), "RLPIPE_TEST_WORKER_PAUSE_FILE": str(paused),
           "RLPIPE_TEST_WORKER_PAUSE": "rlpipe.stages.common.background:wait_for_background@1"}
    handle = ProcessGroup([Process([sys.executable, "-m", "rlpipe.cluster.worker", "--group", str(group.path)],
                                   env, tmp_path / "task.log")])
    groups = ResidentGroups(Launch(launcher="processes"), start_group=None)
    groups.groups["task"] = resident = ResidentGroup("task", group, 1, handle, stall_timeout_s=60)
    resident.seq = 1
    _order(group, 1, tmp_path)
    assert _answer(group, 1)["exit_code"] == 0

    def kill_in_the_save() -> None:
        os.kill(int(_until(lambda: paused.is_file() and paused.read_text())), signal.SIGKILL)

    killer = threading.Thread(target=kill_in_the_save)
    killer.start()
    try:
        with pytest.raises(WorkerLost, match=f"worker task.0 \\(pid {handle.running[0][1].pid}\\) was lost "
                                             "\\(killed by SIGKILL"):
            groups.close(wait=True)
    finally:
        killer.join()
        handle.stop(0)


# -- Kubernetes, with kubectl answered by the test -----------------------------------------------
def test_kubernetes_a_failed_pod_names_the_member_and_stop_waits_for_the_pods(tmp_path, monkeypatch):
    from rlpipe.cluster import kubernetes
    from rlpipe.cluster.placement import KubernetesSpec, StagePlacement

    pods = {"items": [
        {"metadata": {"annotations": {"batch.kubernetes.io/job-completion-index": "0"}}, "status": {"phase": "Running"}},
        {"metadata": {"annotations": {"batch.kubernetes.io/job-completion-index": "1"}},
         "status": {"phase": "Failed", "containerStatuses": [
             {"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}}]}
    calls: list[list[str]] = []

    def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> str:
        calls.append(list(args))
        if args[:2] == ("get", "job"):
            return json.dumps({"status": {"conditions": [{"type": "Failed", "status": "True"}]}})
        return json.dumps(pods) if args[:2] == ("get", "pods") else ""

    monkeypatch.setattr(kubernetes, "_kubectl", kubectl)
    k = KubernetesSpec(namespace="rl", poll_seconds=0.01)
    group = GroupDir.create(tmp_path / "runs" / "mini", "rollout", 2, driver_timeout_s=60)
    docs = kubernetes.group_manifests("rollout", group, StagePlacement(workers=2), k)
    job = kubernetes.JobGroup(docs, k, tmp_path, "rollout")
    assert job.ended() == (137, 1)  # the OOM killer ended member 1
    resident = ResidentGroup("rollout", group, 2, job, stall_timeout_s=60)
    resident.seq = 1
    with pytest.raises(WorkerLost, match="worker rollout.1 was lost \\(killed by SIGKILL"):
        resident._wait({0: tmp_path / "rollout.0.log", 1: tmp_path / "rollout.1.log"})
    # a pod evicted or on a lost node has no exit code: lost too
    pods["items"][1]["status"] = {"phase": "Failed", "reason": "Evicted"}
    assert kubernetes.failed_pod(job.name, ["--namespace", "rl"]) == (None, 1)

    calls.clear()
    job.stop(grace=10)
    name = docs[-1]["metadata"]["name"]
    assert calls == [["delete", "job", name, "--namespace", "rl", "--ignore-not-found", "--grace-period=10",
                      "--wait=false"],
                     ["wait", "--for=delete", "pod", "-l", f"job-name={name}", "--namespace", "rl", "--timeout=70s"]]


# -- Prefect, with the API answered by the test ------------------------------------------------------
def test_prefect_a_crashed_flow_run_is_lost_and_stop_waits_for_its_end(monkeypatch):
    import prefect.client.orchestration as orchestration
    from prefect.states import Cancelled, Cancelling, Completed, Crashed, Failed, Running

    from rlpipe.flows.pools import PoolGroup

    states: list = []
    set_to: list = []

    class Client:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def set_flow_run_state(self, flow_run_id, state, force=False):
            set_to.append((flow_run_id, state.name))

    monkeypatch.setattr(orchestration, "get_client", lambda sync_client=True: Client())
    group = object.__new__(PoolGroup)  # (as started: a flow run of the pool's stage deployment)
    group.flow_run, group.POLL_S = type("FlowRun", (), {"id": "run-1"})(), 0.01

    def read():
        state = states.pop(0) if len(states) > 1 else states[0]
        return type("FlowRun", (), {"state": state})()

    group._read = read
    for state, ended in ((Completed(), (0, None)), (Failed(), (1, None)), (Crashed(), (None, None))):
        states[:], group._last, group._ended = [state], 0.0, None
        assert group.ended() == ended, state
    states[:] = [Running(), Cancelling(), Cancelling(), Cancelled()]
    group.stop(grace=5)
    assert set_to == [("run-1", "Cancelling")] and states[0].is_final()  # it returned once the flow run had ended
