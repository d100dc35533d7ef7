"""Processes on this machine, from start to end: each in its own session (so its children, a
torchrun job's ranks, end with it), its output to its log. `ProcessGroup` starts them and is a
resident group's handle (`rlpipe.cluster.resident.Handle`); `run_processes` runs a call's
processes to their end on one.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlpipe.cluster.failures import StageLaunchError


@dataclass(frozen=True)
class Process:
    """One process of a launch: its argv, environment and log file."""

    argv: list[str]
    env: dict[str, str]
    log: Path
    scratch: Path | None = None
    """A folder the process writes for its launcher only (torchrun's --log-dir, which it would
    otherwise make in the temporary directory and leave there): emptied before the process
    starts, removed once it has ended."""


class ProcessGroup:
    """Processes started together (worker processes, one torchrun job, or an srun step), each in
    its own session with its output to its log; as a resident group's handle
    (`rlpipe.cluster.resident.Handle`), member i is process i when there is one per member."""

    def __init__(self, procs: Sequence[Process]):
        self.running: list[tuple[Process, subprocess.Popen]] = []
        try:
            for proc in procs:
                if proc.scratch is not None:
                    shutil.rmtree(proc.scratch, ignore_errors=True)  # (a killed driver's)
                with open(proc.log, "wb") as out:  # the child keeps its own copy of the descriptor
                    self.running.append((proc, subprocess.Popen(
                        proc.argv, env=proc.env, stdout=out, stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                        start_new_session=True)))
        except BaseException:
            self.stop(0.0)
            raise

    @property
    def logs(self) -> list[Path]:
        return [proc.log for proc, _ in self.running]

    def ended(self) -> tuple[int, int | None] | None:
        for i, (_, popen) in enumerate(self.running):
            code = popen.poll()
            if code is not None:
                return code, i if len(self.running) > 1 else None
        return None

    def wait(self, stage: str, poll: float = 0.05) -> None:
        """Until every process has exited 0; the first other exit code raises StageLaunchError
        (the others still run: `stop` them)."""
        pending = list(self.running)
        while pending:
            for proc, popen in list(pending):
                code = popen.poll()
                if code is None:
                    continue
                pending.remove((proc, popen))
                if code != 0:
                    raise StageLaunchError(stage, code, proc.log)
            time.sleep(poll)

    def stop(self, grace: float) -> None:
        """SIGTERM every process group still running (a worker's torchrun ranks too), SIGKILL
        those still there after `grace` seconds; then remove the processes' scratch folders."""
        alive = [popen for _, popen in self.running if popen.poll() is None]
        for popen in alive:
            os.killpg(popen.pid, signal.SIGTERM)
        deadline = time.time() + grace
        for popen in alive:
            try:
                popen.wait(max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait()
        for proc, _ in self.running:
            if proc.scratch is not None:
                shutil.rmtree(proc.scratch, ignore_errors=True)


def run_processes(stage: str, procs: Sequence[Process], poll: float = 0.05, grace: float = 10.0) -> None:
    """Start every process, wait for all; the first failure stops the others and raises."""
    group = ProcessGroup(procs)
    try:
        group.wait(stage, poll)
    finally:
        group.stop(grace)
