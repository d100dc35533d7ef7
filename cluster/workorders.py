"""Work orders between the driver and a resident worker group: files in the run directory.

A resident group (`rlpipe.cluster.resident`) is the processes of one placed stage, started once
for the run; each stage call of the pipeline becomes a work order the members take, run as
`rlpipe stage <name> -c <saved config>` would, and answer. Files, because they are what every
launcher shares (local processes, srun steps on other nodes, Kubernetes pods, Prefect workers all
see the run directory), and because the manifest already is the completion signal: an order's
answer only says how the members' runs ended.

    runs/<run>/workers/<stage>-<token>/
      group.json                 the driver's: stage, members, driver (host, pid, start), timeouts
      driver.beat                the driver's heartbeat: a counter rewritten every few seconds
      orders/000001.json         an order: {config_file, force, logs}, {make_room: true, logs} or {stop: true}
      done/000001.<member>.json  a member's answer: {exit_code, pid, seconds}
      members/<member>.json      written by a member as it starts (pid, host): one per start
      members/<member>.ready     written once it has imported its stage (torch, transformers, ...)
      members/<member>.beat      the member's heartbeat (its watchdog rewrites it)
      members/<member>.exit      written by a member as it leaves
      members/<member>.failed    written by a member whose write in the background failed (what, why)
      abandon                    written by a later driver of the run: members leave at once

Waiting for news is a doorbell, not a poll's period: whoever writes an order rings each member's
bell, whoever answers rings the driver's (`Doorbell`: a named pipe per listener in this machine's
temporary folder, outside the run directory). A listener on the writer's machine wakes at once; one
on another node hears nothing and finds the file at its next look, every POLL_S, as before.

A driver killed with its groups running leaves their folders behind: the next driver of the run
tells those members to leave, waits until they are gone and removes the folders (`sweep`) before
it starts groups of its own, so two members never write one output.

Members watch the driver (`driver_gone`): on the driver's host by its pid and start time, on
other hosts by its heartbeat, which must change within `driver_timeout_s` (measured on the
member's own clock, so clock skew between nodes plays no part). Every write is atomic (a
temporary name renamed into place): a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import select
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlpipe.schemas.atomic import atomic_write_json
from rlpipe.schemas.errors import MachineError, UserError

#: Where a run's resident groups live, under the run directory.
WORKERS_DIR = "workers"
#: How often members and the driver look for news (orders, answers).
POLL_S = 0.02


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object at `path`, or None while it does not exist."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat field 22): with the
    pid it names a process uniquely, where a pid alone may be reused. "" where /proc is absent;
    None when no such process runs (none exists, or it ended and awaits its parent's wait)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None
        try:  # no /proc (macOS): whether the pid exists is all we can tell
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":  # a zombie: ended, its parent (torchrun) has not reaped it yet
        return None
    return fields[19]


def still_running(process: dict[str, Any]) -> bool:
    """Whether the process a `this_process()` record of this host names still runs (its pid names
    a process that started when it did: a reused pid has another start)."""
    start = process_start(int(process["pid"]))
    return start is not None and not (start and process["start"] and start != process["start"])


def this_process() -> dict[str, Any]:
    """This process's identity: host, pid, start (`still_running` tells whether it still runs)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start(os.getpid())}


@dataclass(frozen=True)
class GroupDir:
    """The folder of one resident group (see the module doc)."""

    path: Path

    @classmethod
    def create(cls, run_dir: Path, stage: str, members: int, *, driver_timeout_s: float,
               weight_channel: bool = False) -> GroupDir:
        """A new group folder for `stage`, with its group.json written (the driver's side).
        `weight_channel`: its members take part in the weight channel (`launch.weight_channel`)."""
        group = cls(run_dir / WORKERS_DIR / f"{stage}-{secrets.token_hex(4)}")
        for sub in ("orders", "done", "members"):
            (group.path / sub).mkdir(parents=True, exist_ok=True)
        atomic_write_json(group.path / "group.json", {"stage": stage, "members": members, "driver": this_process(),
                                                      "driver_timeout_s": driver_timeout_s,
                                                      "weight_channel": weight_channel})
        group.beat(0)
        return group

    @property
    def info(self) -> dict[str, Any]:
        info = read_json(self.path / "group.json")
        if info is None:
            raise FileNotFoundError(f"{self.path} holds no group.json: not a resident worker group")
        return info

    # -- orders and answers ---------------------------------------------------------------
    def order_file(self, seq: int) -> Path:
        return self.path / "orders" / f"{seq:06d}.json"

    def done_file(self, seq: int, member: int) -> Path:
        return self.path / "done" / f"{seq:06d}.{member}.json"

    def send(self, seq: int, order: dict[str, Any], members: int | None = None) -> None:
        """Write order `seq` and ring the bells of the group's `members` (default: group.json's)."""
        atomic_write_json(self.order_file(seq), order)
        for m in range(members if members is not None else self.info["members"]):
            self.bell(m).ring()

    def answer(self, seq: int, member: int, answer: dict[str, Any]) -> None:
        atomic_write_json(self.done_file(seq, member), answer)
        self.bell().ring()

    def bell(self, member: int | None = None) -> Doorbell:
        """The driver's doorbell (rung by answers), or a member's (rung by orders)."""
        ident = hashlib.sha256(str(self.path.absolute()).encode()).hexdigest()[:16]
        return Doorbell(bells_dir() / f"{ident}.{'driver' if member is None else member}")

    def first_unanswered(self, members: list[int]) -> int:
        """The first order that not every one of `members` has answered: where a member starts
        (1 when it is new; a restarted one goes on there, never replaying what it answered)."""
        seq = 1
        while all(self.done_file(seq, m).is_file() for m in members):
            seq += 1
        return seq

    def answers(self, seq: int, members: int) -> dict[int, dict[str, Any]]:
        """The answers to order `seq` so far, by member."""
        found = {m: read_json(self.done_file(seq, m)) for m in range(members)}
        return {m: a for m, a in found.items() if a is not None}

    # -- liveness ---------------------------------------------------------------------------
    def beat(self, count: int, member: int | None = None) -> None:
        """Rewrite the driver's (or a member's) heartbeat."""
        name = "driver.beat" if member is None else f"members/{member}.beat"
        atomic_write_json(self.path / name, {"count": count, "time": time.time()})

    def heartbeat(self, member: int | None = None) -> int | None:
        name = "driver.beat" if member is None else f"members/{member}.beat"
        beat = read_json(self.path / name)
        return None if beat is None else int(beat["count"])

    def member_started(self, member: int, record: dict[str, Any]) -> None:
        atomic_write_json(self.path / "members" / f"{member}.json", record)

    def member_record(self, member: int) -> dict[str, Any] | None:
        return read_json(self.path / "members" / f"{member}.json")

    def member_ready(self, member: int) -> None:
        atomic_write_json(self.path / "members" / f"{member}.ready", {"time": time.time()})

    def all_ready(self, members: int) -> bool:
        return all((self.path / "members" / f"{m}.ready").is_file() for m in range(members))

    def background_failed(self, member: int, what: str, error: BaseException) -> None:
        """A member's write of `what` in the background failed: its driver, which may be waiting
        for that artifact, learns it at its next look (`background_failure`)."""
        atomic_write_json(self.path / "members" / f"{member}.failed",
                          {"what": what, "error": f"{type(error).__name__}: {error}",
                           "user_error": isinstance(error, UserError), "time": time.time()})

    def background_failure(self, member: int) -> dict[str, Any] | None:
        return read_json(self.path / "members" / f"{member}.failed")

    def member_exited(self, member: int) -> None:
        atomic_write_json(self.path / "members" / f"{member}.exit", {"time": time.time()})

    def has_exited(self, member: int) -> bool:
        return (self.path / "members" / f"{member}.exit").is_file()

    def abandon(self) -> None:
        """Tell the members of this group (of an earlier driver) to leave now."""
        atomic_write_json(self.path / "abandon", {"by": this_process(), "time": time.time()})

    @property
    def abandoned(self) -> bool:
        return (self.path / "abandon").is_file()


class DriverWatch:
    """A member's view of its driver: `gone()` is True once the driver has died (on the same
    host: its pid no longer names the process that started the group) or, seen from another
    host, its heartbeat has not changed for `driver_timeout_s` of this member's clock."""

    def __init__(self, group: GroupDir):
        info = group.info
        self.group, self.driver = group, info["driver"]
        self.timeout = float(info["driver_timeout_s"])
        self.same_host = self.driver["host"] == socket.gethostname()
        self.beats: dict[None, tuple[int | None, float]] = {None: (group.heartbeat(), time.monotonic())}
        """The driver's last heartbeat and when it changed (`heartbeat_stopped`)."""

    def gone(self) -> str | None:
        """Why the driver is gone, or None while it lives."""
        if self.group.abandoned:
            return "a later driver of the run abandoned this group"
        if not (self.group.path / "group.json").is_file():
            return "the driver removed this group (it stopped it)"
        if self.same_host:
            return None if still_running(self.driver) else f"the driver (pid {self.driver['pid']}) has exited"
        if heartbeat_stopped(self.beats, None, self.group.heartbeat(), self.timeout):
            return (f"the driver (pid {self.driver['pid']} on {self.driver['host']}) sent no heartbeat for "
                    f"{self.timeout:.0f} s")
        return None


def unanswered(group: GroupDir, members: int, answers: dict, *, here: bool) -> Iterator[tuple[int, dict]]:
    """(member, its record) of each started member that has not answered nor exited, on this host
    (`here`) or on others."""
    host = socket.gethostname()
    for m in range(members):
        record = group.member_record(m)
        if m not in answers and record is not None and (record["host"] == host) == here and not group.has_exited(m):
            yield m, record


def live_members(group: GroupDir, timeout_s: float, since: dict[int, tuple[int | None, float]]) -> list[int]:
    """The members of `group` that may still be running: started, not exited, and (seen by the
    caller across calls, `since` holding each member's last heartbeat and when it changed) with a
    heartbeat that changed within `timeout_s`."""
    info = read_json(group.path / "group.json") or {"members": 0}
    here = socket.gethostname()
    alive = []
    for m in range(int(info["members"])):
        record = group.member_record(m)
        if record is None or group.has_exited(m):
            continue
        if record["host"] == here and not still_running(record):
            continue  # on this host: its process is gone (killed before it could say so)
        if not heartbeat_stopped(since, m, group.heartbeat(m), timeout_s):
            alive.append(m)
    return alive


def heartbeat_stopped(seen: dict[Any, tuple[int | None, float]], key: Any, count: int | None,
                      timeout_s: float) -> bool:
    """Whether the heartbeat of `key` (a member, or None: the driver), now at `count`, has not
    changed for more than `timeout_s` of this process's clock (so clock skew between nodes plays no
    part). `seen` holds, across calls, each key's last count and when it changed; updated here."""
    now = time.monotonic()
    last = seen.get(key)
    if last is None or last[0] != count:
        seen[key] = (count, now)
        return False
    return now - last[1] > timeout_s


def bells_dir() -> Path:
    """This machine's folder of doorbells: the temporary folder's, the user's own."""
    return Path(tempfile.gettempdir()) / f"rlpipe-bells-{os.getuid()}"


@dataclass
class Doorbell:
    """A named pipe one process listens on (`listen`, then `wait`) and others `ring`: a wait for a
    file another process writes that ends when it is written (on this machine; a ring nobody on
    this machine listens to is lost, so a listener still looks for its file every `wait` timeout)."""

    path: Path
    fd: int | None = None

    def listen(self) -> Doorbell:
        """Make the pipe (if need be) and hold it open; without a pipe (a file system without
        them), `wait` is a plain sleep."""
        try:
            self.path.parent.mkdir(mode=0o700, exist_ok=True)
            try:
                os.mkfifo(self.path, 0o600)
            except FileExistsError:
                if not stat.S_ISFIFO(os.lstat(self.path).st_mode):
                    return self
            # read and write: the pipe always has a writer, so a wait blocks until a ring
            self.fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)
        except OSError:
            self.fd = None
        return self

    def wait(self, timeout: float) -> None:
        """Until a ring (the rings so far all taken) or `timeout` seconds."""
        if self.fd is None:
            time.sleep(timeout)
            return
        if select.select([self.fd], [], [], timeout)[0]:
            try:
                while os.read(self.fd, 4096):
                    pass
            except BlockingIOError:
                pass

    def ring(self) -> None:
        """Wake the listener, if one listens on this machine (never blocks, never raises)."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no pipe, or nobody listening (ENXIO): it looks for its file anyway
            return
        try:
            os.write(fd, b"!")
        except OSError:  # a full pipe (EAGAIN) has rings enough
            pass
        finally:
            os.close(fd)

    def close(self) -> None:
        """Stop listening; the pipe goes."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            self.path.unlink()
        except OSError:
            pass


# -- a killed driver's groups ------------------------------------------------------------------
#: Seconds a later driver waits for the members of an earlier driver's groups to leave.
ABANDON_WAIT_S = 30.0
#: A member heartbeat older than this (s) means the member is gone (it beats every second).
MEMBER_TIMEOUT_S = 10.0


def sweep(workers: Path) -> None:
    """Abandon the groups in `workers` (left by an earlier driver of the run, which was killed),
    wait until their members have left, and remove them: a new group never starts while an old
    member may still write into the run (MachineError if one still runs after ABANDON_WAIT_S)."""
    if not workers.is_dir():
        return
    old = [GroupDir(d) for d in sorted(workers.iterdir()) if (d / "group.json").is_file()]
    for g in old:
        g.abandon()
    still = wait_gone(old, ABANDON_WAIT_S)
    if still:
        raise still_running_error(still[0], "an earlier driver of this run")
    for d in workers.iterdir():
        if d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
    remove_worker_files(workers)


def remove_worker_files(workers: Path) -> None:
    """The files of a run's workers/ folder, beside its groups' folders: the weight channel's
    address (stages/common/weight_channel.py), written by optimize's rank 0."""
    for f in workers.iterdir():
        if f.is_file():
            f.unlink(missing_ok=True)


def wait_gone(groups: list[GroupDir], timeout: float) -> list[GroupDir]:
    """Wait until no member of `groups` may still run (each left, or its process on this host is
    gone, or its heartbeat stopped for MEMBER_TIMEOUT_S), at most `timeout` s; returns the groups
    with a member that may still run."""
    seen: dict[Path, dict] = {}
    deadline = time.monotonic() + timeout
    while True:
        groups = [g for g in groups if live_members(g, MEMBER_TIMEOUT_S, seen.setdefault(g.path, {}))]
        if not groups or time.monotonic() >= deadline:
            return groups
        time.sleep(0.2)


def still_running_error(group: GroupDir, whose: str) -> MachineError:
    """The error of a group whose members still run after being told to leave."""
    members = [group.member_record(m) or {} for m in live_members(group, MEMBER_TIMEOUT_S, {})]
    where = ", ".join(f"pid {r.get('pid')} on {r.get('host')}" for r in members) or "unknown processes"
    return MachineError(f"workers of {whose} ({group.path}: {where}) still run after being told to leave "
                        f"{ABANDON_WAIT_S:.0f} s ago, so a new group could not start without two workers writing "
                        "one output: end those processes (or wait for their node to come back or be removed), "
                        "then rerun the same command")
