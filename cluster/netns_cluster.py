"""A Slurm cluster of separate nodes on one machine: each node a network + UTS + mount namespace
with its own host name, its own address on a private bridge, its own /tmp and Slurm spool, for the
multi-node tests and for trying a multi-node preset before the real cluster.

    python -m rlpipe.cluster.netns_cluster up [--nodes 2] [--state /var/tmp/rlpipe-nodes] [--share DIR ...]
    export SLURM_CONF=/var/tmp/rlpipe-nodes/slurm.conf     # (printed by `up`)
    python -m rlpipe.cluster.netns_cluster down [--state /var/tmp/rlpipe-nodes]

What a node is, and what it shares (as on a real cluster):

- its network: a namespace `rlpipe-node<i>` joined to the bridge `rlpipe-nodes` by a veth pair,
  address 10.213.7.<i+1>/24 on its `eth0` and its own loopback; the bridge has 10.213.7.254, so
  this machine's own processes (sbatch, srun, the test) reach every node. One private /24 used
  nowhere else, no route out and no NAT: traffic stays inside the namespaces made here;
- its host name (`node<i>`, a UTS namespace), its own processes (a pid namespace: another node's
  pids mean nothing there) and its own /tmp and /dev/shm (tmpfs in a mount namespace of its own),
  so host names, pids in heartbeats, node-local caches, shared memory and ports are per node;
- shared, as NFS would be: the rest of the file system (the repository, the virtualenv, the run
  directory) and munge's socket; a directory under /tmp given with `shared` is bound back into each
  node's /tmp at the same path.

slurmctld runs on node 0, one slurmd per node (`-N node<i>`, its spool under the node's own /tmp);
the jobs slurmd starts live in its node's namespaces. `down` kills every process in each node's
namespace, deletes the namespaces, links and bridge, stops munge, and checks that nothing is left.
Needs root (namespaces, links) and Debian's slurm-wlm and munge (`slurm_local.install`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rlpipe.cluster.slurm_local import SLURM_CONF, SlurmUnavailable, install, start_munge

SUBNET = "10.213.7"
BRIDGE = "rlpipe-nodes"
NETNS = "rlpipe-node{i}"
HOST = "node{i}"
DEFAULT_STATE = Path("/var/tmp/rlpipe-nodes")
CTLD_PORT, SLURMD_PORT = 6817, 6818  # (each node has its own addresses: the defaults are free)


def address(i: int) -> str:
    return f"{SUBNET}.{i + 1}"


def node_conf(nodes: int, cpus: int, memory_mb: int) -> str:
    """slurm.conf's node and partition lines for `nodes` nodes on the bridge."""
    lines = [f"NodeName={HOST.format(i=i)} NodeAddr={address(i)} CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN"
             for i in range(nodes)]
    names = ",".join(HOST.format(i=i) for i in range(nodes))
    return "\n".join([*lines, f"PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP", ""])


def slurm_conf(state: Path, nodes: int, cpus: int, memory_mb: int) -> str:
    """The one-node cluster's slurm.conf (`slurm_local.SLURM_CONF`: why each key) with node 0 as the
    controller, every node on the bridge, and each node's spool in its own /tmp."""
    base = SLURM_CONF.format(s=state, ctld_port=CTLD_PORT, d_port=SLURMD_PORT, cpus=cpus, memory_mb=memory_mb)
    kept = [line for line in base.splitlines() if not line.startswith(("NodeName=", "PartitionName=",
                                                                       "SlurmctldHost=", "SlurmdSpoolDir=",
                                                                       "SlurmdPidFile=", "SlurmdLogFile="))]
    return "\n".join([f"SlurmctldHost={HOST.format(i=0)}({address(0)})", *kept,
                      "SlurmdSpoolDir=/tmp/slurmd", "SlurmdPidFile=/tmp/slurmd.pid",
                      f"SlurmdLogFile={state}/log/slurmd.%n.log", node_conf(nodes, cpus, memory_mb)])


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def hosts_file(nodes: int) -> str:
    """/etc/hosts as the nodes see it: each node's name at its address on the bridge."""
    return "".join(["127.0.0.1 localhost\n", *(f"{address(i)} {HOST.format(i=i)}\n" for i in range(nodes))])


def in_node(i: int, command: str, state: Path, shared: Sequence[Path] = ()) -> list[str]:
    """argv running shell `command` on node i: in its network namespace, with its host name, the
    cluster's hosts file (`state`/hosts) and its own /tmp (a tmpfs; `state` and each of `shared`
    under /tmp bound back at its path)."""
    keep = f"/run/rlpipe-node{i}-shared"
    kept = [state, *shared]
    binds = [f"mkdir -p {keep}/{k} && mount --bind {shlex.quote(str(p))} {keep}/{k}" for k, p in enumerate(kept)]
    back = [f"mkdir -p {shlex.quote(str(p))} && mount --bind {keep}/{k} {shlex.quote(str(p))}"
            for k, p in enumerate(kept)]
    script = " && ".join([f"hostname {HOST.format(i=i)}", f"mount --bind {shlex.quote(str(state / 'hosts'))} /etc/hosts",
                          *binds, "mount -t tmpfs -o mode=1777 tmpfs /tmp", *back, "mkdir -p /tmp/slurmd",
                          "mount -t tmpfs -o mode=1777 tmpfs /dev/shm",
                          f"exec {command}"])
    # nsenter, not `ip netns exec`: that mounts the namespace's own /sys, without the host's cgroup
    # file systems, which slurmd's plugins read
    return ["nsenter", f"--net=/var/run/netns/{NETNS.format(i=i)}", "unshare", "--uts", "--mount", "--pid", "--fork",
            "--mount-proc", "--propagation", "private", "sh", "-c", script]


class NodeCluster:
    """`nodes` nodes in `state` (see the module doc): `up()`, `env` for sbatch / srun / sinfo,
    `down()`. Also a context manager (down on exit, a failure included)."""

    def __init__(self, state: Path = DEFAULT_STATE, nodes: int = 2, *, cpus: int = 4,
                 shared: Sequence[Path] = ()):
        self.state, self.nodes, self.cpus = Path(state).absolute(), nodes, cpus
        self.shared = sorted({Path(p).absolute() for p in shared if str(Path(p).absolute()).startswith("/tmp/")})
        self.env = {**os.environ, "SLURM_CONF": str(self.state / "slurm.conf")}
        self.daemons: list[subprocess.Popen] = []

    def up(self, timeout: float = 60.0) -> NodeCluster:
        install()
        if os.geteuid() != 0:
            raise SlurmUnavailable("a cluster of namespaces needs root (network namespaces, links)")
        self.down()  # (what a killed run left)
        try:
            self._network()
            for d in ("state", "run"):
                (self.state / d).mkdir(parents=True, exist_ok=True)
            start_munge(self.state)
            (self.state / "hosts").write_text(hosts_file(self.nodes))
            (self.state / "slurm.conf").write_text(slurm_conf(self.state, self.nodes, self.cpus, 2000))
            conf = f"-f {self.state / 'slurm.conf'}"
            self.start(0, f"slurmctld -D {conf}", "slurmctld")
            for i in range(self.nodes):
                self.start(i, f"slurmd -D {conf} -N {HOST.format(i=i)}", f"slurmd.{i}")
            self._wait_idle(timeout)
        except BaseException:
            self.down()
            raise
        return self

    def _network(self) -> None:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{SUBNET}.254/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for i in range(self.nodes):
            ns, veth = NETNS.format(i=i), f"{BRIDGE}-{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", BRIDGE, "up")
            _ip("-n", ns, "addr", "add", f"{address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def start(self, i: int, command: str, name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start `command` on node i in the background, its output in `state`/log/`name`.out (a
        session of its own: signal its group to stop it; `down` ends it in any case)."""
        log = open(self.state / "log" / f"{name}.out", "ab")  # noqa: SIM115 (the daemon's, for its life)
        proc = subprocess.Popen(in_node(i, command, self.state, self.shared), env=env or self.env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.daemons.append(proc)
        return proc

    def _wait_idle(self, timeout: float) -> None:
        deadline, out = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True,
                                 text=True).stdout.strip()
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if len(states) == self.nodes and set(states.values()) == {"idle"}:
                return
            if self.daemons and self.daemons[-1].poll() is not None:  # (the daemon just started failed)
                break
            time.sleep(0.5)
        raise SlurmUnavailable(f"the cluster's nodes did not become idle within {timeout:.0f} s (sinfo: {out!r}); "
                               f"logs in {self.state}/log")

    def run_on(self, i: int, command: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess:
        """Run shell `command` on node i (its namespaces) and wait for it."""
        return subprocess.run(in_node(i, f"sh -c {shlex.quote(command)}", self.state, self.shared),
                              env=env or self.env, capture_output=True, text=True, **kwargs)

    def lose(self, i: int) -> None:
        """Node i is lost: every process in its namespace SIGKILLed, its link taken down."""
        _kill_netns(NETNS.format(i=i))
        _ip("link", "set", f"{BRIDGE}-{i}", "down", check=False)

    def restore(self, i: int, timeout: float = 60.0) -> None:
        """Node i (lost) is back: its link up and a new slurmd, which Slurm returns to service."""
        _ip("link", "set", f"{BRIDGE}-{i}", "up")
        self.start(i, f"slurmd -D -f {self.state / 'slurm.conf'} -N {HOST.format(i=i)}", f"slurmd.{i}")
        # Its jobs died with it: down (which ends them there), then back to service, as an admin would.
        for state in ("DOWN Reason=lost", "RESUME"):
            subprocess.run(["scontrol", "update", f"NodeName={HOST.format(i=i)}", *f"State={state}".split()],
                           env=self.env, capture_output=True)
        self._wait_idle(timeout)

    def down(self) -> None:
        """Stop everything `up` started and remove every namespace and link (idempotent)."""
        for i in range(16):
            ns = NETNS.format(i=i)
            if _ip("netns", "pids", ns, check=False).returncode == 0:
                _kill_netns(ns)
                _ip("netns", "del", ns, check=False)
            _ip("link", "del", f"{BRIDGE}-{i}", check=False)
            shutil.rmtree(f"/run/rlpipe-node{i}-shared", ignore_errors=True)  # (mount points, empty here)
        _ip("link", "del", BRIDGE, check=False)
        for d in self.daemons:
            d.wait(10)
        self.daemons = []
        pid_file = self.state / "msock" / "munged.pid"
        try:
            os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
        except (OSError, ValueError):
            pass
        pid_file.unlink(missing_ok=True)

    def leftovers(self) -> list[str]:
        """What of the cluster is still there: namespaces, links, folders, live processes that name
        its state folder (empty after `down`)."""
        netns = [n for n in _ip("netns", "list").stdout.split() if n.startswith("rlpipe-node")]
        links = [line for line in _ip("-o", "link", "show").stdout.splitlines() if BRIDGE in line]
        folders = [str(p) for p in Path("/run").glob("rlpipe-node*-shared")]
        return netns + links + folders + [f"pid {p}: {c[:120]}" for p, c in processes_naming(str(self.state)).items()]

    def __enter__(self) -> NodeCluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


def processes_naming(needle: str, pids: Sequence[str] | None = None) -> dict[int, str]:
    """Live (not zombie) processes, of `pids` (this machine's numbering) or all, whose command
    line holds `needle`: pid -> command line."""
    found = {}
    for proc in (Path(f"/proc/{p}") for p in pids) if pids is not None else Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            zombie = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except (OSError, IndexError):
            continue
        if needle in cmdline and not zombie and int(proc.name) != os.getpid():
            found[int(proc.name)] = cmdline
    return found


def node_processes(i: int, needle: str) -> list[int]:
    """The pids (this machine's numbering) of node i's processes whose command line holds `needle`."""
    return sorted(processes_naming(needle, _ip("netns", "pids", NETNS.format(i=i), check=False).stdout.split()))


def _kill_netns(ns: str) -> None:
    for _ in range(50):
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlpipe.cluster.netns_cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["up", "down"])
    p.add_argument("--state", type=Path, default=DEFAULT_STATE, help="folder of every Slurm and munge file")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--share", type=Path, nargs="*", default=[], help="folders under /tmp every node sees")
    a = p.parse_args(argv)
    cluster = NodeCluster(a.state, a.nodes, shared=a.share)
    try:
        if a.action == "up":
            cluster.up()
            print(f"export SLURM_CONF={cluster.env['SLURM_CONF']}")
        else:
            cluster.down()
    except (SlurmUnavailable, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
