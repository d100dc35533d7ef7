"""Command lines that start a stage on N ranks (torchrun or the deepspeed launcher). (The DeepSpeed
JSON templates shipped in cluster/deepspeed/ are read by `stages.common.deepspeed`.)

Generic on purpose: Slurm / Kubernetes templates wrap these command lines; nothing here knows a
scheduler. Example:

    >>> stage_command("optimize", ["-c", "cfg.yaml"], nproc_per_node=2)
    ['torchrun', '--nproc_per_node', '2', '--nnodes', '1', '--node_rank', '0', '--master_addr', '127.0.0.1', '--master_port', '29500', '-m', 'rlpipe.stages.optimize', '-c', 'cfg.yaml']
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Literal

Launcher = Literal["torchrun", "deepspeed"]

#: Where single-machine launches rendezvous: nothing listens on a network address.
LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A port free on `host` now (the OS picks it; closed again before the launch binds it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def stage_command(stage: str, args: Sequence[str] = (), *, nproc_per_node: int = 1, nnodes: int = 1,
                  node_rank: int = 0, master_addr: str = "127.0.0.1", master_port: int = 29500,
                  launcher: Launcher = "torchrun", hostfile: str | None = None,
                  module: str | None = None, log_dir: str | None = None) -> list[str]:
    """argv that runs `python -m rlpipe.stages.<stage> <args>` on nnodes x nproc_per_node ranks.

    Args:
        module: run this module instead of the stage's (a resident worker: rlpipe.cluster.worker).
        log_dir: torchrun's folder for its per-rank files (default: a new `torchelastic_*` folder
            in the temporary directory, which torchrun leaves behind).
        launcher: 'torchrun' (sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_*) or 'deepspeed'
            (the deepspeed launcher; with `hostfile` it ssh-es to the listed hosts itself).
    """
    if nproc_per_node < 1 or nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"bad topology: nnodes={nnodes} node_rank={node_rank} nproc_per_node={nproc_per_node}")
    from rlpipe.cluster.submit import module_for

    module = module or module_for(stage)  # the registry's module (or the smoke test's)
    if launcher == "torchrun":
        return ["torchrun", "--nproc_per_node", str(nproc_per_node), "--nnodes", str(nnodes),
                "--node_rank", str(node_rank), "--master_addr", master_addr, "--master_port", str(master_port),
                *(["--log-dir", log_dir] if log_dir else []), "-m", module, *args]
    if launcher == "deepspeed":
        cmd = ["deepspeed", "--num_gpus", str(nproc_per_node)]
        if hostfile is not None:
            cmd += ["--hostfile", hostfile, "--num_nodes", str(nnodes)]
        elif nnodes > 1:
            raise ValueError("the deepspeed launcher needs a hostfile for nnodes > 1")
        return cmd + ["--master_addr", master_addr, "--master_port", str(master_port), "--module", module, *args]
    raise ValueError(f"unknown launcher {launcher!r}; known: torchrun, deepspeed")


def local_env(base: Mapping[str, str] | None = None, *, cpu: bool = True, threads_per_rank: int = 1) -> dict[str, str]:
    """Environment for a local multi-rank CPU run: DeepSpeed's CPU accelerator, one thread per rank."""
    env = dict(os.environ if base is None else base)
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    env["OMP_NUM_THREADS"] = str(threads_per_rank)
    return env


def torchrun_executable() -> str:
    """The torchrun next to this interpreter (a venv's bin), else 'torchrun' from PATH."""
    candidate = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return candidate if os.path.exists(candidate) else "torchrun"
