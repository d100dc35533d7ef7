"""Run model-written Python in a contained subprocess: the `python` tool of multi-turn episodes.

A call never raises because of what the code does. Whatever happens (an exception, a timeout, a
memory or output limit, a refused file or network access, the process killed) comes back as a
`SandboxResult` whose `reply()` is the text the model reads as the tool's answer.

Every call runs a fresh `python -I` process (isolated mode: no user site, no PYTHON* variables,
no cwd on the path; `sandbox_child.py`) in its own session, with a minimal environment and a
scratch folder (deleted afterwards) as its working directory, HOME and TMPDIR, under
- resource limits (setrlimit): address space `memory_mb`, CPU seconds, the size of any file it
  writes, open files, `max_processes` processes (counted over its uid; the kernel does not hold
  root to it, which only 'rlimits_only' under root leaves it as); and a wall-clock `timeout_s`
  after which its whole process group is killed;
- no_new_privs: setuid programs and file capabilities give it nothing;
- stdout and stderr into files (bounded by the file-size limit) of which the first
  `max_output_chars` characters each are kept.

`sandbox` picks what else holds:
- 'strict' (the default): the process enters new mount and network namespaces (and a user
  namespace unless it runs as root) before the code starts. Its filesystem is a fresh read-only
  root holding only /usr, /bin, /sbin, /lib*, /etc/ld.so.cache, /dev/{null,zero,random,urandom}
  and Python's prefixes (interpreter, standard library, the venv's packages): the run directory,
  home directories, /etc, /tmp, /proc and everything else are not there; the scratch folder is the
  one place it can write. Its network namespace has no interface but a loopback that is down, so
  no socket reaches anything (through ctypes or not). It then runs as nobody (when started by
  root) or as its own user, with no capability left in any namespace: it cannot remount, unmount
  or leave either namespace. If any step fails the code does not run (`status` 'sandbox').
  What it does not prevent: using the CPU, memory and disk its limits allow, and signalling
  other processes of the same uid (no pid namespace).
- 'rlimits_only': the limits above and nothing more. The code can read and write whatever the
  run's user can. An audit hook refuses socket creation and connections from Python code, which
  ctypes goes around: it stops honest code, not hostile code. For machines where namespaces are
  not allowed (`strict_sandbox_error` says why), chosen in the environment's config.
"""

from __future__ import annotations

import functools
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

SandboxMode = Literal["strict", "rlimits_only"]
SANDBOX_MODES: tuple[str, ...] = get_args(SandboxMode)
#: The program the sandbox's process runs; it contains itself, then the code (in the child, so
#: nothing unsafe happens between fork and exec in the caller, which may hold threads and locks).
CHILD = Path(__file__).with_name("sandbox_child.py")


@dataclass(frozen=True)
class SandboxResult:
    """What one run did. `status`: 'ok', 'error' (non-zero exit: an exception, usually),
    'timeout', 'memory' (the address-space limit was hit), 'killed' (another signal), or
    'sandbox' (the strict sandbox could not be set up, so the code did not run: `setup_error`)."""

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    seconds: float
    isolation: str  # the mode that held ('strict', 'rlimits_only'), or 'none' (the code never ran)
    setup_error: str | None = None

    def reply(self) -> str:
        """The tool's answer as the model reads it."""
        out = self.stdout.rstrip("\n")
        if self.status == "ok":
            return out if out else "(no output)"
        cause = {"timeout": "stopped: the time limit was reached",
                 "memory": "stopped: the memory limit was reached",
                 "killed": f"stopped: the process was killed (exit {self.exit_code})",
                 "error": f"the code failed (exit {self.exit_code})",
                 "sandbox": f"the sandbox could not be set up, so the code did not run: {self.setup_error}"
                 }[self.status]
        tail = _last_lines(self.stderr, 8)
        return "\n".join(part for part in (out, cause, tail) if part)


def _last_lines(text: str, n: int) -> str:
    return "\n".join(text.rstrip("\n").splitlines()[-n:])


def run_python(code: str, *, sandbox: SandboxMode = "strict", timeout_s: float = 5.0, memory_mb: int = 512,
               max_output_chars: int = 4000, max_file_mb: int = 16, max_processes: int = 16) -> SandboxResult:
    """Run `code` as a Python program in the `sandbox` mode above and report what happened."""
    if sandbox not in SANDBOX_MODES:
        raise ValueError(f"sandbox {sandbox!r}: choose one of {', '.join(SANDBOX_MODES)}")
    root = Path(tempfile.mkdtemp(prefix="rlpipe-sandbox-"))
    scratch = root / "work"  # the code's working directory and HOME; its output goes beside it
    scratch.mkdir()
    (root / "fs").mkdir()  # where the strict sandbox builds its root filesystem
    (root / "main.py").write_text(code)
    env = {"PATH": os.defpath, "HOME": str(scratch), "TMPDIR": str(scratch), "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    limits = [memory_mb << 20, int(timeout_s) + 1, max_file_mb << 20, 64, max_processes]
    started = time.perf_counter()
    try:
        # Output into files, not pipes: the file-size limit bounds what a print loop can write.
        with open(root / "stdout", "wb") as out, open(root / "stderr", "wb") as err:
            proc = subprocess.Popen([sys.executable, "-I", str(CHILD), str(root), sandbox, *map(str, limits)],
                                    cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
            timed_out = not _wait(proc, timeout_s)
            if timed_out:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        stdout, stderr = (_read_clipped(root / name, max_output_chars) for name in ("stdout", "stderr"))
        held = (root / "isolation").read_text() if (root / "isolation").exists() else ""
    finally:
        shutil.rmtree(root, ignore_errors=True)
    seconds = time.perf_counter() - started
    failed = held.removeprefix("failed: ") if held.startswith("failed: ") else None
    isolation = held if held in SANDBOX_MODES else "none"
    return SandboxResult(_status(proc.returncode, timed_out, stderr, failed), proc.returncode, stdout, stderr,
                         seconds, isolation, failed)


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Whether `proc` ends within `timeout_s`. A pidfd wakes this the moment it does: Popen.wait's
    timeout polls with doubling sleeps, which turned a 33 ms call into 64 ms."""
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:  # a kernel before 5.3
        try:
            proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poll = select.poll()
        poll.register(fd, select.POLLIN)
        return bool(poll.poll(timeout_s * 1000))
    finally:
        os.close(fd)


def _status(exit_code: int, timed_out: bool, stderr: str, setup_error: str | None) -> str:
    if setup_error is not None:
        return "sandbox"
    if timed_out or exit_code == -signal.SIGXCPU:
        return "timeout"
    if exit_code == 0:
        return "ok"
    if "MemoryError" in stderr:
        return "memory"
    return "killed" if exit_code < 0 else "error"


@functools.cache
def strict_sandbox_error() -> str | None:
    """Why the strict sandbox cannot be set up on this machine, or None where it can (tried once
    per process, by running an empty program in it)."""
    result = run_python("", sandbox="strict", timeout_s=30.0)
    if result.status == "ok" and result.isolation == "strict":
        return None
    return result.setup_error or result.reply()


def _read_clipped(path: Path, limit: int) -> str:
    """The first `limit` characters of a file (read from its first 4 x `limit` bytes)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        text = f.read(4 * limit).decode("utf-8", errors="replace")
    if len(text) <= limit and size <= 4 * limit:
        return text
    return text[:limit] + f"\n[... output cut at {limit} characters ({size} bytes in all)]"
