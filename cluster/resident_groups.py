"""The resident groups of one run, the driver's side: one group per placed iteration stage,
started at its first call (`ResidentGroup`, resident.py: its orders, answers and faults), the
driver's heartbeat for them, and their end when the run ends or fails."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from rlpipe.cluster.failures import StageLaunchError
from rlpipe.cluster.placement import Launch, StagePlacement
from rlpipe.cluster.resident import STOP_GRACE_S, ResidentGroup, StartGroup, members_of
from rlpipe.cluster.workorders import (
    ABANDON_WAIT_S,
    WORKERS_DIR,
    GroupDir,
    remove_worker_files,
    still_running_error,
    sweep,
)
from rlpipe.schemas.pending import wait_until_written
from rlpipe.stages import StageCall, get_stage


class ResidentGroups:
    """The resident groups of one run (one per placed iteration stage), the driver's heartbeat
    for them, and their end (`close`)."""

    def __init__(self, launch: Launch, start_group: StartGroup):
        self.launch, self.start_group = launch, start_group
        self.groups: dict[str, ResidentGroup] = {}
        self.started: dict[str, int] = {}
        """How many groups of each stage this run started (1 per placed stage, unless one failed)."""
        self._beating = threading.Event()
        self._swept: set[Path] = set()
        self._leaving: dict[str, ResidentGroup] = {}
        """Stopped groups whose members had not all gone within the wait (stage -> group)."""

    def run(self, call: StageCall, p: StagePlacement, force: bool, logs: Path) -> Path:
        """Run `call` on its stage's group (started now if it has none); returns its log."""
        group = self.groups.get(call.name)
        if group is None:
            group = self.groups[call.name] = self._start(call, p, logs.parent)
        if not self.takes_weights(call.name):
            for path in call.config.inputs().values():
                if Path(path).absolute() not in group.writing:  # (its own writes: the stage waits for them)
                    wait_until_written(path)  # (a policy still written by optimize's member: its file)
        try:
            return group.run(call, force, logs, send_weights_to=self._receivers(call.name))
        except BaseException:
            self._drop(call.name, group)
            raise

    def takes_weights(self, stage: str) -> bool:
        """Whether `stage` takes the policy over the weight channel (`launch.weight_channel`, a
        receiving stage: rollout)."""
        return self.launch.weight_channel and get_stage(stage).weights == "receive"

    def _receivers(self, stage: str) -> ResidentGroup | None:
        """The live group a sending stage's (optimize's) new policy goes to, if any."""
        if not self.launch.weight_channel or get_stage(stage).weights != "send":
            return None
        return next((g for name, g in self.groups.items() if self.takes_weights(name)), None)

    def make_room(self, stages: Sequence[str], logs: Path) -> None:
        """The live groups of `stages` free the GPU memory their engines hold (a vLLM engine sleeps,
        the next rollout wakes it), before a training stage on the same GPUs (`Launch.make_room_for`)."""
        for name in stages:
            group = self.groups.get(name)
            if group is None:
                continue
            try:
                group.make_room(logs)
            except BaseException:
                self._drop(name, group)
                raise

    def _drop(self, stage: str, group: ResidentGroup) -> None:
        """A group whose order failed: stopped; the next call of the stage starts a fresh one."""
        self.groups.pop(stage, None)
        group.stop()
        if not group.gone:
            self._leaving[stage] = group

    def _start(self, call: StageCall, p: StagePlacement, logs_root: Path) -> ResidentGroup:
        old = self._leaving.pop(call.name, None)
        if old is not None and not old.wait_gone(ABANDON_WAIT_S):  # (a retry: never beside the old members)
            self._leaving[call.name] = old
            raise still_running_error(old.group, f"the failed {call.name} group")
        run_dir = logs_root.parent
        if run_dir not in self._swept:  # groups an earlier (killed) driver of this run left
            sweep(run_dir / WORKERS_DIR)
            self._swept.add(run_dir)
        members = members_of(call.name, p)
        timeout = self.launch.driver_timeout_s
        group = GroupDir.create(run_dir, call.name, members, driver_timeout_s=timeout,
                                weight_channel=self.launch.weight_channel and get_stage(call.name).weights is not None)
        self._start_beating()
        folder = logs_root / WORKERS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        handle = self.start_group(call.name, p, group, members, folder)
        self.started[call.name] = self.started.get(call.name, 0) + 1
        return ResidentGroup(call.name, group, members, handle, self.launch.stall_timeout_s)

    def _start_beating(self) -> None:
        """The driver's heartbeat for members on other hosts: every group's counter, rewritten
        six times per driver_timeout_s."""
        if self._beating.is_set():
            return
        self._beating.set()
        period = max(0.5, self.launch.driver_timeout_s / 6)

        def beat() -> None:
            count = 0
            while self._beating.is_set():
                count += 1
                for g in list(self.groups.values()):
                    with contextlib.suppress(OSError):
                        g.group.beat(count)
                time.sleep(period)

        threading.Thread(target=beat, daemon=True, name="rlpipe-driver-beat").start()

    def close(self, *, wait: bool = False) -> None:
        """Stop every group: at the end of a run (`wait`: up to `launch.stall_timeout_s` for the
        members to finish their background saves), or at once (it failed or was interrupted)."""
        grace = self.launch.stall_timeout_s if wait else STOP_GRACE_S
        failures = []
        while self.groups:
            _, group = self.groups.popitem()
            failures += [(group, m, code) for m, code in group.stop(grace).items()]
        self._beating.clear()
        for run_dir in self._swept:
            with contextlib.suppress(OSError):
                remove_worker_files(run_dir / WORKERS_DIR)  # (the weight channel's address, for this run)
                (run_dir / WORKERS_DIR).rmdir()  # (only when empty)
        if failures and wait:  # the run's last train state (written in the background) is missing
            group, member, code = failures[0]
            log = group.member_log(member)
            raise StageLaunchError(group.stage, code, log or group.group.path, "it did not answer the stop order: "
                                   "its last background save (the run's last train state) is unfinished",
                                   member, group.pids.get(member), lost=code is None)
