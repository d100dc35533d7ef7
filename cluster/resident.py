"""Resident worker groups, the driver's side: a placed stage starts once per run and takes each
iteration's stage call as a work order (`rlpipe.cluster.worker`, `rlpipe.cluster.workorders`).

A placed launcher (`rlpipe.cluster.placed.PlacedLauncher`) with `launch.resident` (the default)
hands every call of an RL iteration to `ResidentGroups.run` (resident_groups.py): the first
call of a stage starts its group through the launcher's `start_group` (N processes, a torchrun
job, an srun step, a Kubernetes Job, a Prefect flow run), every call sends the saved config as an
order and waits for every member's answer. Set-up stages (called once: sft, reward_model) launch per call as before.

Faults end a call within seconds, never in a hang, with a `StageLaunchError` naming the stage and
the tail of its log: a member that answers with a non-zero exit code; a member process that dies
(its launcher's handle reports it: killed by a signal or gone without an exit code, it is a
`WorkerLost`, the machine's failure, also when its peers failed first because of it); a member
of another host silent (no heartbeat) for `launch.driver_timeout_s`: its node lost, not retried;
members alive but silent (no log output) for `launch.stall_timeout_s`. The failed group is stopped, and
the next call (a retry, or the same command rerun) starts a fresh one only once every old member
is gone (whose optimize replays from the last saved train state, as any fresh process does).
Members leave when the run ends (a stop order), when the driver is interrupted (`close`), and
when it dies (their watchdog sees its pid or heartbeat go): no worker outlives its run.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from rlpipe.cluster.failures import StageLaunchError, killed_by, root_cause
from rlpipe.cluster.logs import stage_log
from rlpipe.cluster.placement import StagePlacement
from rlpipe.cluster.workorders import (
    ABANDON_WAIT_S,
    POLL_S,
    GroupDir,
    bells_dir,
    heartbeat_stopped,
    still_running,
    unanswered,
    wait_gone,
)
from rlpipe.schemas.errors import ArtifactError
from rlpipe.schemas.manifest import Manifest
from rlpipe.schemas.pending import register_elsewhere
from rlpipe.stages import StageCall, get_stage

_log = logging.getLogger(__name__)

#: Seconds a stopped group gets to leave before it is killed.
STOP_GRACE_S = 10.0


class Handle(Protocol):
    """The processes of a started group, as its launcher sees them."""

    def ended(self) -> tuple[int | None, int | None] | None:
        """(exit code, member or None) of a process of the group that has ended; None while all
        run. An exit code of None: it ended without one (a pod evicted or on a lost node, a flow
        run that crashed): the member was lost."""
        ...

    def stop(self, grace: float) -> None:
        """End every process of the group (a stop order was sent first: they may have left), and
        wait until they have ended: processes, pods deleted, a flow run in a final state."""
        ...

    @property
    def logs(self) -> list[Path]:
        """The files the group's own output (start-up, between orders) goes to."""
        ...


#: launcher.start_group(stage, placement, group, members, folder): start the members, their own
#: output in `folder` (runs/<run>/logs/workers/).
StartGroup = Callable[[str, StagePlacement, GroupDir, int, Path], Handle]


def members_of(stage: str, p: StagePlacement) -> int:
    """How many members a stage's group has: its worker processes or its ranks."""
    return p.workers if get_stage(stage).scaling == "shards" else p.nodes * p.ranks_per_node


class ResidentGroup:
    """One started group: sends orders, waits for the answers."""

    def __init__(self, stage: str, group: GroupDir, members: int, handle: Handle, stall_timeout_s: float):
        self.stage, self.group, self.members, self.handle = stage, group, members, handle
        self.stall_timeout_s = stall_timeout_s
        self.seq = 0
        self.started_at = time.monotonic()
        self.gone = False
        """Stopped, and every member has left (`stop`): a new group of the stage may start."""
        self.pids: dict[int, int | None] = {}
        """The processes of the members that failed the stop order (`stop`)."""
        self.bell = group.bell().listen()
        """Rung by every answer: the driver waits on it (POLL_S at most) instead of sleeping."""
        self.beats: dict[int, tuple[int | None, float]] = {}  # members' heartbeats seen (`_lost`)
        self.silence_s = float(group.info["driver_timeout_s"])  # (a member's too: `_lost`)
        self.writing: set[Path] = set()
        """What the members answered their last order with as still written in the background
        (the policy sent over the weight channel): their next order waits for it itself."""

    def run(self, call: StageCall, force: bool, logs: Path, send_weights_to: ResidentGroup | None = None) -> Path:
        """Send `call` as the next order and wait for every member's answer; returns the first
        member's log of it. Raises StageLaunchError (see the module doc).

        `send_weights_to`: the group the call's new policy goes to over the weight channel
        (stages/common/weight_channel.py). The policy is then written in the background: this
        process knows it by the manifest the member answered with until its files are complete."""
        self.seq += 1
        out = {m: stage_log(logs, self.stage, m, self.members) for m in range(self.members)}
        for log in set(out.values()):
            log.write_bytes(b"")  # this call's output only, as a per-call launch leaves it
        order = {"config_file": str(call.config_file.absolute()), "force": force,
                 "logs": {str(m): str(p.absolute()) for m, p in out.items()}}
        if send_weights_to is not None:
            to = send_weights_to.group.path
            order["weight_channel"] = {"folder": str(to.parent), "group": to.name, "members": send_weights_to.members}
        self.group.send(self.seq, order, self.members)
        self._wait(out)
        if (failed := self.failed_write()) is not None:  # (what it answered with will never be complete)
            raise failed
        self.writing = set()
        for answer in self.group.answers(self.seq, self.members).values():
            for path, manifest in answer.get("writing", {}).items():
                self.writing.add(Path(path).absolute())
                register_elsewhere(path, Manifest.model_validate_json(manifest), alive=self.alive,
                                   failed=self.failed_write)
        return out[0]

    def alive(self) -> bool:
        """Whether the group's processes are running (its background writes may still complete)."""
        return not self.gone and self.handle.ended() is None

    def failed_write(self) -> Exception | None:
        """The error of a member's write in the background that failed (`GroupDir.background_failed`),
        if one did: an ArtifactError where the cause is the user's to fix (a full disk)."""
        for m in range(self.members):
            record = self.group.background_failure(m)
            if record is not None:
                message = (f"{self.stage} worker {m} could not finish writing {record['what']} in the "
                           f"background: {record['error']}")
                return ArtifactError(message) if record["user_error"] else RuntimeError(message)
        return None

    def make_room(self, logs: Path) -> None:
        """A make-room order (`rlpipe.cluster.worker`: free the GPU memory the member's engine holds)
        and every member's answer; its lines go to this iteration's log of the stage, under `logs`."""
        self.seq += 1
        out = {m: stage_log(logs, self.stage, m, self.members) for m in range(self.members)}
        self.group.send(self.seq, {"make_room": True, "logs": {str(m): str(p.absolute()) for m, p in out.items()}},
                        self.members)
        self._wait(out)

    def _wait(self, out: dict[int, Path]) -> None:
        watched = [*set(out.values()), *self.handle.logs]
        size, changed = -1, time.monotonic()
        while True:
            answers = self.group.answers(self.seq, self.members)
            # (an exit by a signal, 143 when torchrun ends the peers of a failed rank, comes last)
            failed = sorted((m for m, a in answers.items() if a["exit_code"] != 0),
                            key=lambda m: (killed_by(answers[m]["exit_code"]) is not None, m))
            if failed:
                # (a failed background write, a full disk, is the cause of the order that found it)
                if (write := self.failed_write()) is not None:
                    raise write
                first = answers[failed[0]]
                # A peer lost mid-order makes the others fail too (a collective whose rank died,
                # a save it shared): the loss is the cause.
                raise self._lost(answers, out) or StageLaunchError(
                    self.stage, first["exit_code"], out[failed[0]], member=failed[0], pid=first["pid"])
            if len(answers) == self.members:
                return
            ended = self.handle.ended()
            if ended is not None:
                if self.group.answers(self.seq, self.members).keys() != answers.keys():
                    continue  # it answered and left between the two looks: read the answer
                raise self._ended(*ended, out)
            if (lost := self._node_lost(answers, out)) is not None:  # (nobody answers for a lost node)
                raise lost
            now_size = sum(_size(p) for p in watched)
            if not self.group.all_ready(self.members):  # starting: imports, a pod pending, a pool's queue
                if time.monotonic() - self.started_at > self.stall_timeout_s:
                    raise StageLaunchError(self.stage, None, self.handle.logs[0] if self.handle.logs else out[0], (
                        f"its workers did not start within {self.stall_timeout_s:.0f} s (launch.stall_timeout_s): "
                        "a pod still pending, a work pool without a worker, an import that hangs?; stopped them"))
                size, changed = now_size, time.monotonic()
            elif now_size != size:
                size, changed = now_size, time.monotonic()
            elif time.monotonic() - changed > self.stall_timeout_s:
                raise StageLaunchError(self.stage, None, out[0], (
                    f"its workers are alive but wrote nothing for {self.stall_timeout_s:.0f} s "
                    f"(launch.stall_timeout_s): stuck (a hung collective, a deadlock, a stalled filesystem?); "
                    "stopped them"))
            self.bell.wait(POLL_S)

    def _ended(self, code: int | None, member: int | None, out: dict[int, Path]) -> StageLaunchError:
        """The error of a group whose process ended (`Handle.ended`) before every member answered."""
        pid = None
        if member is None and self.handle.logs:  # one torchrun job: the rank its report names
            rank, rank_code, pid = root_cause(self.handle.logs[0])
            if rank is not None:
                member, code = rank, rank_code
        log = out[member or 0]
        if _size(log) == 0 and self.handle.logs:  # it died before its first order: its own log
            log = self.handle.logs[min(member or 0, len(self.handle.logs) - 1)]
        record = self.group.member_record(member) if member is not None else None
        pid = pid or (record or {}).get("pid")
        return StageLaunchError(self.stage, code, log, "its process ended without an exit code: a lost node, "
                                "an eviction?", member, pid, lost=code is None)

    def _lost(self, answers: dict[int, dict], out: dict[int, Path]) -> StageLaunchError | None:
        """A member of this host that has not answered and is gone without leaving (killed), if any."""
        for m, record in unanswered(self.group, self.members, answers, here=True):
            if not still_running(record):
                return StageLaunchError(self.stage, None, out[m], "its process is gone without an answer or an "
                                        "exit: killed (the OOM killer, a preemption?)", m, record["pid"], lost=True)
        return None

    def _node_lost(self, answers: dict[int, dict], out: dict[int, Path]) -> StageLaunchError | None:
        """A member of another host that has not answered and whose heartbeat has been still for
        `launch.driver_timeout_s` (the silence its members allow the driver), if any: its node lost
        or cut off, where no launcher's handle may ever say so (an srun step waits for the node)."""
        for m, record in unanswered(self.group, self.members, answers, here=False):
            if heartbeat_stopped(self.beats, m, self.group.heartbeat(m), self.silence_s):
                return StageLaunchError(self.stage, None, out[m], (
                    f"its member on host {record['host']} sent no heartbeat for {self.silence_s:.0f} s "
                    "(launch.driver_timeout_s): that node lost or cut off?"), m, record["pid"], node=record["host"])
        return None

    def stop(self, grace: float = STOP_GRACE_S) -> dict[int, int | None]:
        """A stop order, `grace` seconds to leave (members finish what they write in the
        background first), then the handle's stop (which waits for the processes, pods or flow
        run to end), then until every member is gone (`wait_gone`: its own record says so, on
        any host); the group folder goes with them. `gone` says whether they went. Returns the
        members whose answer to the stop order was an exit code other than 0 (a background save
        failed), with that code, and those that gave none (None: lost before they could finish
        what they wrote in the background). Best effort: it never raises (it runs while another
        error is raised)."""
        stop = self.seq + 1
        with contextlib.suppress(OSError):
            self.group.send(stop, {"stop": True}, self.members)
        deadline, answered = time.monotonic() + grace, False
        while time.monotonic() < deadline and self.handle.ended() is None:  # (a flow run: until it completes)
            if not answered and len(self.group.answers(stop, self.members)) == self.members:
                answered, deadline = True, min(deadline, time.monotonic() + STOP_GRACE_S)  # leaving now
            self.bell.wait(POLL_S)
        answers, ended = self.group.answers(stop, self.members), self.handle.ended()

        def gone_with(m: int) -> int | None:  # how an unanswering member's process ended, where its handle tells
            return ended[0] if ended is not None and ended[0] != 0 and ended[1] in (None, m) else None

        failed = {m: answers[m]["exit_code"] if m in answers else gone_with(m) for m in range(self.members)
                  if m not in answers or answers[m]["exit_code"]}
        self.pids = {m: (self.group.member_record(m) or {}).get("pid") for m in failed}  # (the folder goes)
        try:
            self.handle.stop(grace=STOP_GRACE_S)
        except Exception as e:  # (a scheduler's API call: the members leave with their driver anyway)
            _log.warning(f"stopping the {self.stage} workers: {type(e).__name__}: {e}")
        finally:
            self.wait_gone(ABANDON_WAIT_S)
        return failed

    def wait_gone(self, timeout: float) -> bool:
        """Until no member may still run (at most `timeout` s; members still there are told to
        leave), then the group folder goes; whether they went (`gone`)."""
        with contextlib.suppress(OSError):
            self.group.abandon()
        self.gone = not wait_gone([self.group], timeout)
        if self.gone:
            shutil.rmtree(self.group.path, ignore_errors=True)
            for bell in (self.bell, *(self.group.bell(m) for m in range(self.members))):
                bell.close()  # (a killed member's too)
            with contextlib.suppress(OSError):  # the machine's folder of bells, when no run uses it
                bells_dir().rmdir()
        return self.gone

    def member_log(self, member: int) -> Path | None:
        """The member's own output (start-up, between orders, its stop), where its launcher keeps one."""
        logs = self.handle.logs
        return logs[min(member, len(logs) - 1)] if logs else None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
