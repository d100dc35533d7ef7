"""The work-order files between a driver and its resident groups (rlpipe.cluster.workorders): how
a member tells that its driver is gone, and how a later driver clears a killed one's groups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from rlpipe.cluster.workorders import (
    DriverWatch,
    GroupDir,
    live_members,
    process_start,
    still_running,
    sweep,
    this_process,
)


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _as_driver(group: GroupDir, process: dict, timeout: float = 60.0) -> None:
    info = json.loads((group.path / "group.json").read_text())
    (group.path / "group.json").write_text(json.dumps({**info, "driver": process, "driver_timeout_s": timeout}))


def test_an_order_rings_each_member_and_an_answer_the_driver(tmp_path, monkeypatch):
    """A wait on a bell ends when another process writes the order (not at the next poll); a ring
    nobody listens to is lost without blocking, and the wait then ends at its timeout."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    group = GroupDir.create(tmp_path, "rollout", 2, driver_timeout_s=60)
    driver, member = group.bell().listen(), group.bell(1).listen()
    assert driver.fd is not None and member.fd is not None
    group.bell(0).ring()  # (member 0 does not listen: nothing happens)
    ring = ("import sys, time; from pathlib import Path; from rlpipe.cluster.workorders import GroupDir; "
            "time.sleep(1.0); GroupDir(Path(sys.argv[1])).send(1, {'force': False})")
    child = subprocess.Popen([sys.executable, "-c", ring, str(group.path)], env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
    started = time.monotonic()
    while group.order_file(1).is_file() is False:
        member.wait(120.0)
    woke = time.monotonic() - started
    assert child.wait(60) == 0 and 1.0 <= woke < 60.0  # woken by the ring, long before the 120 s timeout
    started = time.monotonic()
    driver.wait(0.3)  # no ring: the timeout
    assert 0.25 <= time.monotonic() - started < 30.0
    group.answer(1, 1, {"exit_code": 0})
    started = time.monotonic()
    driver.wait(120.0)
    assert time.monotonic() - started < 60.0
    for bell in (driver, member):
        bell.close()
    assert list((tmp_path / "tmp").glob("rlpipe-bells-*/*")) == []


def test_orders_and_answers_round_trip(tmp_path):
    group = GroupDir.create(tmp_path, "rollout", 2, driver_timeout_s=60)
    assert group.path.parent == tmp_path / "workers" and group.path.name.startswith("rollout-")
    assert group.info["members"] == 2 and group.info["driver"] == this_process()
    group.send(1, {"config_file": "/x.yaml", "force": False})
    assert json.loads(group.order_file(1).read_text())["config_file"] == "/x.yaml"
    group.answer(1, 1, {"exit_code": 0})
    assert group.answers(1, 2) == {1: {"exit_code": 0}}
    assert not any(p.name.endswith(".tmp") for p in group.path.rglob("*"))  # written atomically


def test_a_member_sees_its_driver_die_on_the_same_host(tmp_path):
    driver = _sleeper()
    try:
        record = {**this_process(), "pid": driver.pid, "start": process_start(driver.pid)}
        group = GroupDir.create(tmp_path, "optimize", 1, driver_timeout_s=60)
        _as_driver(group, record)
        watch = DriverWatch(group)
        assert watch.same_host and watch.gone() is None and still_running(record)
    finally:
        driver.kill()
        driver.wait()
    assert watch.gone() == f"the driver (pid {driver.pid}) has exited"
    # a pid reused by another process has another start time: still gone
    assert not still_running({**record, "pid": 1, "start": "0"})


def test_a_member_on_another_host_follows_the_heartbeat(tmp_path):
    group = GroupDir.create(tmp_path, "optimize", 1, driver_timeout_s=0.3)
    _as_driver(group, {**this_process(), "host": "elsewhere"}, timeout=0.3)
    watch = DriverWatch(group)
    assert not watch.same_host
    for count in range(1, 6):  # a beating driver stays alive however long it lives
        group.beat(count)
        time.sleep(0.1)
        assert watch.gone() is None
    time.sleep(0.4)  # it stopped beating
    assert watch.gone() == f"the driver (pid {this_process()['pid']} on elsewhere) sent no heartbeat for 0 s"


def test_an_abandoned_group_is_gone_for_its_members(tmp_path):
    group = GroupDir.create(tmp_path, "score", 1, driver_timeout_s=60)
    watch = DriverWatch(group)
    group.abandon()
    assert watch.gone() == "a later driver of the run abandoned this group"


def test_a_later_driver_clears_a_killed_drivers_groups(tmp_path):
    """Members that left, and members on this host whose process is gone, are not waited for."""
    dead = _sleeper()
    dead.kill()
    dead.wait()
    left = GroupDir.create(tmp_path, "rollout", 2, driver_timeout_s=60)
    for m in (0, 1):
        left.member_started(m, this_process())
    left.member_exited(0)
    left.member_started(1, {**this_process(), "pid": dead.pid, "start": "1"})
    assert live_members(left, 10.0, {}) == []
    alive = GroupDir.create(tmp_path, "optimize", 1, driver_timeout_s=60)
    alive.member_started(0, this_process())  # this very process: alive
    assert live_members(alive, 10.0, {}) == [0]
    alive.member_exited(0)
    started = time.monotonic()
    sweep(tmp_path / "workers")
    assert time.monotonic() - started < 5 and list((tmp_path / "workers").iterdir()) == []


def test_a_failed_last_background_save_fails_the_end_of_the_run(tmp_path, monkeypatch):
    """At the stop order a member waits for its background save (the run's last train state) and
    answers with its exit code; a failure there (a full disk: 2) fails the driver's close(wait),
    which the run would otherwise end as a success without its last train state."""
    import threading

    import pytest

    from rlpipe.cluster import worker
    from rlpipe.cluster.failures import StageUserError
    from rlpipe.cluster.placement import Launch
    from rlpipe.cluster.resident import ResidentGroup
    from rlpipe.cluster.resident_groups import ResidentGroups
    from rlpipe.schemas.errors import ArtifactError
    from rlpipe.stages.common import background

    def full_disk() -> None:
        raise ArtifactError("iter_0004/train_state: no space left on the device holding iter_0004")

    monkeypatch.setattr(background, "wait_for_background", full_disk)
    group = GroupDir.create(tmp_path, "optimize", 1, driver_timeout_s=60)
    codes: list[int] = []
    member = threading.Thread(target=lambda: codes.append(worker.serve(group, "optimize", 0, 1)))
    member.start()

    class Handle:  # the member above: a thread here, a process on a cluster
        logs = [tmp_path / "optimize.log"]

        def ended(self):
            return None if member.is_alive() else (codes[0], None)

        def stop(self, grace):
            member.join(grace)

    Handle.logs[0].write_text("[rlpipe worker optimize.0] error: ...no space left...\n")
    groups = ResidentGroups(Launch(launcher="processes"), start_group=None)
    groups.groups["optimize"] = ResidentGroup("optimize", group, 1, Handle(), stall_timeout_s=5)
    with pytest.raises(StageUserError, match="stage optimize failed \\(exit code 2\\)"):
        groups.close(wait=True)
    assert codes == [2] and not group.path.exists()
