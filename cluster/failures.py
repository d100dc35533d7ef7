"""How a launched stage failed, as the driver tells it: the stage's own report (a user error: 2,
a bug: 1), or a process of the stage that was lost to its machine (killed by a signal, a pod or
flow run that failed without an exit code).

`StageLaunchError(stage, exit_code, log)` picks its class from the exit code: `StageUserError`
for the stage's 2 (one `error:` paragraph, not retried), `WorkerLost` for a process killed by a
signal (a `MachineError`: one `error:` paragraph naming the stage, the process and its log, exit
code 3, retried as the stage's retries say), else a crash with the tail of the log.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from rlpipe.schemas.errors import MachineError, UserError

LOG_TAIL_LINES = 40


class StageLaunchError(RuntimeError):
    """A launched stage failed: its exit code and the tail of its log. Not a UserError: a crashed
    worker can be transient, so Prefect retries it as configured in the stage registry. Exit code
    2, the stage's own report of a user error, makes it a `StageUserError`: not retried, shown as
    one `error:` paragraph. A process killed by a signal, or `lost` (ended without an exit code:
    a failed pod, a crashed flow run), makes it a `WorkerLost`.

    Args:
        member: which member (worker or rank) of the stage ended, where the launcher knows it.
        pid: that member's process id, where known.
        lost: the process ended without an exit code, taken by its machine.
        node: the host of a member lost with its node (silent past `launch.driver_timeout_s`):
            not retried, as the allocation that lost it cannot take the group again.
    """

    def __new__(cls, stage: str, exit_code: int | None, log: Path, detail: str = "",
                member: int | None = None, pid: int | None = None, lost: bool = False, node: str | None = None):
        if cls is StageLaunchError:
            code = rank_exit_code(exit_code, log)
            if code == 2:
                cls = StageUserError
            elif lost or node is not None or killed_by(code) is not None:
                cls = WorkerLost
        return super().__new__(cls)

    def __init__(self, stage: str, exit_code: int | None, log: Path, detail: str = "",
                 member: int | None = None, pid: int | None = None, lost: bool = False, node: str | None = None):
        self.stage, self.log, self.detail = stage, log, detail
        self.member, self.pid, self.lost, self.node = member, pid, lost or node is not None, node
        self.launcher_exit_code, self.exit_code = exit_code, rank_exit_code(exit_code, log)
        super().__init__(self._message())

    def _message(self) -> str:
        how = f"exit code {self.exit_code}" if self.launcher_exit_code is not None else self.detail
        how += f", torchrun's {self.launcher_exit_code}" if self.exit_code != self.launcher_exit_code else ""
        tail = log_tail(self.log)
        cause = _last_error(self.log)
        cause = f"\n{cause}" if cause and cause not in tail else ""
        return (f"stage {self.stage} failed ({how}){cause}\nlast lines of {self.log}:\n{tail}"
                if tail else f"stage {self.stage} failed ({how}); no output in {self.log}")

    def __reduce__(self):  # (pickled as it was made: the message is built from these)
        return StageLaunchError, (self.stage, self.launcher_exit_code, self.log, self.detail, self.member,
                                  self.pid, self.lost, self.node)


class StageUserError(StageLaunchError, UserError):
    """A launched stage stopped on a user error (exit code 2: its `error:` line is in the log's tail)."""


class WorkerLost(StageLaunchError, MachineError):
    """A process of a launched stage was lost to its machine: killed by a signal (the OOM killer,
    a preemption, a person), or gone without an exit code (a node that went away). Neither the
    user's input nor rlpipe is at fault: one paragraph naming the stage, the member and its log."""

    def _message(self) -> str:
        rank, _, pid = root_cause(self.log) if self.member is None else (None, None, None)
        member = self.member if self.member is not None else rank
        pid = self.pid or pid
        who = f"worker {self.stage}.{member}" if member is not None else f"a worker of {self.stage}"
        who += f" (pid {pid})" if pid else ""
        sig = killed_by(self.exit_code)
        how = (f"killed by {_signal_name(sig)}: the OOM killer, a preemption or a lost node?" if sig is not None
               else self.detail or "it ended without an exit code: a lost node, an eviction?")
        return (f"stage {self.stage}: {who} was lost ({how}); its log: {self.log}. This is the machine's "
                "failure, not a problem with the run: what was complete is kept, rerun the same command to resume")


def killed_by(exit_code: int | None) -> int | None:
    """The signal that ended a process, from its exit code: -N (Python's subprocess) or 128 + N
    (a shell, srun, Kubernetes: 137 for SIGKILL); None for an exit of its own."""
    if exit_code is None:
        return None
    if exit_code < 0:
        return -exit_code
    return exit_code - 128 if 128 < exit_code <= 128 + 64 else None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    if not path.is_file():
        return ""
    text = path.read_text(errors="replace").rstrip("\n").splitlines()
    return "\n".join(text[-lines:])


def root_cause(log: Path) -> tuple[int | None, int | None, int | None]:
    """(rank, exit code, pid) of the failed rank that torchrun's 'Root Cause' block, printed
    last, names; Nones when the log holds none."""
    if not log.is_file():
        return None, None, None
    found = _ROOT_CAUSE.findall(log.read_text(errors="replace"))
    if not found:
        return None, None, None
    rank, code, pid = found[-1]
    return int(rank), int(code), int(pid) if pid else None


def rank_exit_code(exit_code: int | None, log: Path) -> int | None:
    """The failed rank's exit code: torchrun exits 1 whatever its rank's code was (a user error's
    2 included), and names that code in the 'Root Cause' block it prints last."""
    if exit_code != 1:
        return exit_code
    code = root_cause(log)[1]
    return exit_code if code is None else code


_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?^\s*rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)"
                         r"(?:\s*\(pid:\s*(\d+)\))?", re.S | re.M)


def _last_error(log: Path) -> str:
    """The last `SomeError: ...` line of a log that is not the launcher's own (torchrun prints its
    ChildFailedError after the rank's traceback, which then scrolls out of the tail)."""
    if not log.is_file():
        return ""
    found = [line for line in log.read_text(errors="replace").splitlines()
             if _ERROR_LINE.search(line) and "ChildFailedError" not in line]
    return found[-1] if found else ""


_ERROR_LINE = re.compile(r"(^|\s)(\w+(Error|Exception)|error): ")
