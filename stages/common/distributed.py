"""The torch.distributed process group of the training stages (sft, reward_model, optimize).

One rule for every stage:
- Launched on several ranks: torchrun / the deepspeed launcher set RANK, WORLD_SIZE, LOCAL_RANK and
  MASTER_ADDR/MASTER_PORT; under a bare `srun` (one task per rank, MASTER_ADDR exported by the
  sbatch script) the Slurm variables SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID stand in for
  them. The group joins that rendezvous (env://).
- A plain process (no launcher): a 1-rank group on an in-memory store, its gloo device bound to
  the loopback interface (never to the address the host name resolves to, which on a cluster
  node is a public interface and in a sandbox may not resolve at all). An in-memory store leaves
  no file behind, even when the process is killed.
- Backend: nccl when CUDA is available, else gloo (with DeepSpeed's CPU accelerator).
An existing group is reused (several stages in one process, tests); `destroy_distributed` ends it.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass

#: Slurm's per-task variables, as the env:// rendezvous names them.
_SLURM_TO_TORCH = {"SLURM_PROCID": "RANK", "SLURM_NTASKS": "WORLD_SIZE", "SLURM_LOCALID": "LOCAL_RANK"}
#: The value GLOO_SOCKET_IFNAME had before a single-process group replaced it (restored on destroy).
_saved_ifname: list[str | None] = []


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the group."""

    rank: int
    world_size: int
    local_rank: int


def backend() -> str:
    """nccl on CUDA, else gloo."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def launched_env(env: dict[str, str] | os._Environ | None = None) -> dict[str, str] | None:
    """RANK / WORLD_SIZE / LOCAL_RANK of a multi-rank launch (torchrun's variables, else Slurm's),
    or None for a plain process. MASTER_ADDR must be set for either: it names the rendezvous."""
    env = os.environ if env is None else env
    if "MASTER_ADDR" not in env:
        return None
    if "RANK" in env and "WORLD_SIZE" in env:
        return {"RANK": env["RANK"], "WORLD_SIZE": env["WORLD_SIZE"], "LOCAL_RANK": env.get("LOCAL_RANK", "0")}
    if all(k in env for k in ("SLURM_PROCID", "SLURM_NTASKS")) and int(env["SLURM_NTASKS"]) > 1:
        return {torch_name: env.get(slurm_name, "0") for slurm_name, torch_name in _SLURM_TO_TORCH.items()}
    return None


def loopback_interface() -> str:
    """Name of the loopback network interface ('lo' on Linux, 'lo0' on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in ("lo", "lo0"):
        if name in names:
            return name
    raise RuntimeError(f"no loopback interface among {names}; set GLOO_SOCKET_IFNAME to it")


def init_distributed() -> DistInfo:
    """Join the launcher's process group, or start a 1-rank group on loopback; reuse an existing one."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported
    if not dist.is_initialized():
        launched = launched_env()
        if launched is not None:
            os.environ.update(launched)  # DeepSpeed and env:// read these names
            dist.init_process_group(backend(), init_method="env://")
        else:
            os.environ.setdefault("LOCAL_RANK", "0")
            if not cuda:
                # Gloo picks its interface from GLOO_SOCKET_IFNAME when it creates a device, for this
                # group and for every group created later (DeepSpeed makes some), so it stays set
                # while the group lives.
                _saved_ifname.append(os.environ.get("GLOO_SOCKET_IFNAME"))
                os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
            dist.init_process_group(backend(), store=dist.HashStore(), rank=0, world_size=1)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank)


def destroy_distributed() -> None:
    """End the process group (if any) and restore what a single-process group changed."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        # DeepSpeed caches groups derived from the world group (a clone of it, the data-parallel
        # group); they die with it, and a new world group needs new ones.
        for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP",
                     "_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP"):
            if hasattr(groups, name):
                setattr(groups, name, None)
    while _saved_ifname:
        previous = _saved_ifname.pop()
        if previous is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = previous


def barrier() -> None:
    """Wait for every rank (a no-op with one rank)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
