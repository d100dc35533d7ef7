"""The one process-group rule: launcher variables (torchrun's, else Slurm's), or 1 rank on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from rlpipe.stages.common.distributed import launched_env

# A plain process: start the group, list the TCP sockets it listens on (/proc/net/tcp, matched to
# this process's socket inodes), end the group.
PROBE = r"""
import json, os, socket, struct
import torch, torch.distributed as dist
from rlpipe.stages.common.distributed import destroy_distributed, init_distributed

info = init_distributed()
x = torch.ones(3)
dist.all_reduce(x)
inodes = set()
for fd in os.listdir("/proc/self/fd"):
    target = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
    if target.startswith("socket:["):
        inodes.add(target[8:-1])
listening = []
for line in open("/proc/net/tcp").read().splitlines()[1:]:
    f = line.split()
    if f[3] == "0A" and f[9] in inodes:  # state 0A = LISTEN
        listening.append(socket.inet_ntoa(struct.pack("<I", int(f[1].split(":")[0], 16))))
during = os.environ.get("GLOO_SOCKET_IFNAME")
destroy_distributed()
print(json.dumps({"rank": info.rank, "world": info.world_size, "sum": x.tolist(), "listening": listening,
                  "ifname_during": during, "ifname_after": os.environ.get("GLOO_SOCKET_IFNAME"),
                  "initialized_after": dist.is_initialized()}))
"""


def test_single_process_group_binds_loopback_and_leaves_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")
           and not k.startswith("SLURM_")}
    env.update(TMPDIR=str(tmp_path), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert (got["rank"], got["world"], got["sum"]) == (0, 1, [1.0, 1.0, 1.0])
    assert got["listening"] and set(got["listening"]) == {"127.0.0.1"}, got["listening"]
    assert got["ifname_during"] in ("lo", "lo0")
    assert got["ifname_after"] is None and got["initialized_after"] is False  # restored, ended
    assert list(tmp_path.iterdir()) == []  # no store file or directory, during or after


def test_launcher_variables():
    torchrun = {"MASTER_ADDR": "n0", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "SLURM_PROCID": "0"}
    assert launched_env(torchrun) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}  # torchrun's win
    slurm = {"MASTER_ADDR": "n0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    assert launched_env(slurm) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}
    # one Slurm task (e.g. torchrun inside it, or a plain run), or no rendezvous address: 1 rank
    assert launched_env({"MASTER_ADDR": "n0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None
    assert launched_env({"RANK": "0", "WORLD_SIZE": "2"}) is None
    assert launched_env({}) is None
