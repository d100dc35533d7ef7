"""Run model-written Python in a contained subprocess: the `python` tool of multi-turn episodes.

A call never raises because of what the code does. Whatever happens (an exception, a timeout, a
memory or output limit, a refused network access, the process killed) comes back as a
`SandboxResult` whose `reply()` is the text the model reads as the tool's answer.

Containment, per call:
- a fresh `python -I` process (isolated mode: no user site, no PYTHON* variables, no cwd on the
  path) in its own session, with a minimal environment and a scratch directory as its working
  directory and HOME (deleted afterwards);
- resource limits (setrlimit): address space `memory_mb`, CPU seconds, the size of any file it
  writes, open files; and a wall-clock `timeout_s` after which its whole process group is killed;
- no network: the process enters a network namespace of its own (only a loopback that is down)
  where the kernel allows it (root, or CAP_SYS_ADMIN); elsewhere an audit hook installed before
  the code runs refuses socket creation and connections (strong against Python code, not against
  ctypes). `network_isolation` says which one held;
- at most `max_processes` processes (enforced by the kernel for users other than root; the wall
  clock's group kill ends any it started).
- stdout and stderr go to files (bounded by the file-size limit) of which the first
  `max_output_chars` characters each are kept.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

#: The program the sandbox runs (`python -I -c BOOTSTRAP LIMITS...`): it contains itself, then runs
#: ./main.py as __main__. In the child process, so nothing unsafe happens between fork and exec
#: in the caller (which may hold threads and locks). Its own frames are cut from tracebacks.
BOOTSTRAP = """
import ctypes, resource, sys, traceback
for which, value in zip((resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_FSIZE,
                         resource.RLIMIT_NOFILE, resource.RLIMIT_NPROC), map(int, sys.argv[1:6])):
    resource.setrlimit(which, (value, value))
if ctypes.CDLL(None, use_errno=True).unshare(0x40000000) == 0:  # CLONE_NEWNET
    isolation = "namespace"
else:
    def _no_network(event, args):
        if event in ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo"):
            raise PermissionError("network access is disabled in this sandbox")
    sys.addaudithook(_no_network)  # Python code cannot remove it
    isolation = "audit_hook"
with open("../isolation", "w") as f:
    f.write(isolation)
source = open("../main.py").read()
import linecache
linecache.cache["main.py"] = (len(source), None, source.splitlines(True), "main.py")  # tracebacks quote it
del ctypes, resource, linecache, which, value, f
sys.argv = ["main.py"]
try:
    exec(compile(source, "main.py", "exec"), {"__name__": "__main__"})
except SystemExit:
    raise
except BaseException as e:
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
"""


@dataclass(frozen=True)
class SandboxResult:
    """What one run did. `status`: 'ok', 'error' (non-zero exit: an exception, usually),
    'timeout', 'memory' (the address-space limit was hit), or 'killed' (another signal)."""

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    seconds: float
    network_isolation: str  # 'namespace', 'audit_hook', or 'none' (the code never started)

    def reply(self) -> str:
        """The tool's answer as the model reads it."""
        out = self.stdout.rstrip("\n")
        if self.status == "ok":
            return out if out else "(no output)"
        cause = {"timeout": "stopped: the time limit was reached",
                 "memory": "stopped: the memory limit was reached",
                 "killed": f"stopped: the process was killed (exit {self.exit_code})",
                 "error": f"the code failed (exit {self.exit_code})"}[self.status]
        tail = _last_lines(self.stderr, 8)
        return "\n".join(part for part in (out, cause, tail) if part)


def _last_lines(text: str, n: int) -> str:
    return "\n".join(text.rstrip("\n").splitlines()[-n:])


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 4000,
               max_file_mb: int = 16, max_processes: int = 16) -> SandboxResult:
    """Run `code` as a Python program under the limits above and report what happened."""
    root = Path(tempfile.mkdtemp(prefix="rlpipe-sandbox-"))
    scratch = root / "work"  # the code's working directory and HOME; its output goes beside it
    scratch.mkdir()
    (root / "main.py").write_text(code)
    env = {"PATH": os.defpath, "HOME": str(scratch), "TMPDIR": str(scratch), "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    limits = [memory_mb << 20, int(timeout_s) + 1, max_file_mb << 20, 64, max_processes]
    started = time.perf_counter()
    try:
        # Output into files, not pipes: the file-size limit bounds what a print loop can write.
        with open(root / "stdout", "wb") as out, open(root / "stderr", "wb") as err:
            proc = subprocess.Popen([sys.executable, "-I", "-c", BOOTSTRAP, *map(str, limits)], cwd=scratch,
                                    env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
            try:
                proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                timed_out = True
        stdout, stderr = (_read_clipped(root / name, max_output_chars) for name in ("stdout", "stderr"))
        isolation = (root / "isolation").read_text() if (root / "isolation").exists() else "none"
    finally:
        shutil.rmtree(root, ignore_errors=True)
    seconds = time.perf_counter() - started
    exit_code = proc.returncode
    if timed_out or exit_code == -signal.SIGXCPU:
        status = "timeout"
    elif exit_code == 0:
        status = "ok"
    elif "MemoryError" in stderr:
        status = "memory"
    elif exit_code < 0:
        status = "killed"
    else:
        status = "error"
    return SandboxResult(status, exit_code, stdout, stderr, seconds, isolation)


def _read_clipped(path: Path, limit: int) -> str:
    """The first `limit` characters of a file (read from its first 4 x `limit` bytes)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        text = f.read(4 * limit).decode("utf-8", errors="replace")
    if len(text) <= limit and size <= 4 * limit:
        return text
    return text[:limit] + f"\n[... output cut at {limit} characters ({size} bytes in all)]"
