"""A real one-node Slurm cluster on this machine, for tests and trying `rlpipe submit slurm`:
munge + slurmctld + slurmd with every file in one state folder, on loopback and free ports.

    python -m rlpipe.cluster.slurm_local up   [--state /tmp/rlpipe-slurm]   # make slurm-up
    export SLURM_CONF=/tmp/rlpipe-slurm/slurm.conf                          # (printed by `up`)
    python -m rlpipe.cluster.slurm_local down [--state /tmp/rlpipe-slurm]   # make slurm-down

`up` installs Debian's slurm-wlm and munge first when they are missing (apt-get, as root); slurmd
runs as root. Why these slurm.conf keys (docs/recipes.md#slurm): munge is the only
authentication Slurm ships; proctrack/linuxproc, task/none, no accounting and no MPI avoid
cgroups, slurmdbd and PMI, which a test box lacks; ReturnToService=2 brings the node back after a
restart; `config_overrides` lets the node declare more CPUs than the machine has (MIN_CPUS).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rlpipe.cluster.launch import free_port

BINARIES = ("sbatch", "srun", "sinfo", "slurmctld", "slurmd", "munged", "mungekey")
PACKAGES = ("slurm-wlm", "munge")
DEFAULT_STATE = Path("/tmp/rlpipe-slurm")
#: Daemons in the order `down` stops them (pid files under the state folder).
PID_FILES = ("run/slurmd.pid", "run/slurmctld.pid", "msock/munged.pid")

SLURM_CONF = """\
ClusterName=rlpipe-test
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={s}/msock/munge.socket.2
CredType=cred/munge
StateSaveLocation={s}/state
SlurmdSpoolDir={s}/spool
SlurmctldPidFile={s}/run/slurmctld.pid
SlurmdPidFile={s}/run/slurmd.pid
SlurmctldLogFile={s}/log/slurmctld.log
SlurmdLogFile={s}/log/slurmd.log
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here (not installed and not installable, or not root)."""


def missing() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def install() -> None:
    """Install slurm-wlm and munge from the distribution's packages when a binary is missing."""
    if not missing():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"Slurm is not installed ({', '.join(missing())} missing) and cannot be "
                               f"installed here (needs root and apt-get): apt-get install {' '.join(PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SlurmUnavailable(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    if missing():
        raise SlurmUnavailable(f"installed {' '.join(PACKAGES)}, but {', '.join(missing())} is still missing")



def env_for(state: Path) -> dict[str, str]:
    """This process's environment pointed at the cluster in `state` (SLURM_CONF)."""
    return {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}


#: CPUs the node declares at least: the resident srun steps of a run hold their CPUs side by side
#: for the whole run (rollout workers beside optimize ranks), more than a laptop's cores; the
#: node's slurm.conf line stands (`SlurmdParameters=config_overrides`) and the tasks share the cores.
MIN_CPUS = 8


def up(state: Path = DEFAULT_STATE, *, cpus: int | None = None, timeout: float = 60.0) -> dict[str, str]:
    """Install if needed, configure and start a one-node cluster in `state`; returns the
    environment to run sbatch / srun / sinfo with. The node has `cpus` CPUs (default: this
    machine's, at least MIN_CPUS)."""
    install()
    if os.geteuid() != 0:
        raise SlurmUnavailable("the one-node Slurm cluster runs slurmd as root")
    state = state.absolute()
    if (state / "run" / "slurmctld.pid").is_file():
        down(state)
    for d in ("run", "state", "spool"):
        (state / d).mkdir(parents=True, exist_ok=True)
    memory_mb = max(1000, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // 2)
    (state / "slurm.conf").write_text(SLURM_CONF.format(
        s=state, ctld_port=free_port(), d_port=free_port(), cpus=cpus or max(MIN_CPUS, os.cpu_count() or 1),
        memory_mb=memory_mb))
    env = env_for(state)
    start_munge(state)
    subprocess.run(["slurmctld"], env=env, check=True)
    subprocess.run(["slurmd", "-N", "localhost"], env=env, check=True)
    deadline, out = time.time() + timeout, ""
    while time.time() < deadline:  # the node registers, then is idle
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True).stdout.strip()
        if out == "idle":
            return env
        time.sleep(0.5)
    down(state)
    raise SlurmUnavailable(f"the Slurm node never became idle (sinfo: {out!r}); logs in {state}/log")


def start_munge(state: Path) -> None:
    """munged with its key, socket, pid, log and seed under `state` (msock/, munge/, log/)."""
    for d in ("munge", "msock", "log"):
        (state / d).mkdir(parents=True, exist_ok=True)
    # munged wants every folder above its socket world-executable, its key folder private.
    state.chmod(0o755)
    (state / "msock").chmod(0o755)
    (state / "munge").chmod(0o700)
    key = state / "munge" / "munge.key"
    if not key.is_file():
        subprocess.run(["mungekey", "-c", "-k", str(key)], check=True, capture_output=True)
    subprocess.run(["munged", f"--key-file={key}", f"--socket={state}/msock/munge.socket.2",
                    f"--pid-file={state}/msock/munged.pid", f"--log-file={state}/log/munged.log",
                    f"--seed-file={state}/munge/munged.seed"], check=True)


def down(state: Path = DEFAULT_STATE, grace: float = 10.0) -> None:
    """Stop the daemons of the cluster in `state` (SIGTERM, then SIGKILL after `grace` s)."""
    for pid_file in PID_FILES:
        path = state / pid_file
        try:
            pid = int(path.read_text().strip())
        except (OSError, ValueError):
            continue
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            continue
        deadline = time.time() + grace
        while time.time() < deadline and _alive(pid):
            time.sleep(0.1)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
        path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlpipe.cluster.slurm_local", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["up", "down", "install"])
    p.add_argument("--state", type=Path, default=DEFAULT_STATE, help="folder of every Slurm file")
    a = p.parse_args(argv)
    try:
        if a.action == "install":
            install()
        elif a.action == "up":
            env = up(a.state)
            print(f"export SLURM_CONF={env['SLURM_CONF']}")
        else:
            down(a.state)
    except SlurmUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
