"""Cluster smoke test: every rank all-reduces (rank + 1) and checks the sum is W(W+1)/2.

    python -m rlpipe.cluster.submit slurm --stage smoke --nodes 2 --gpus-per-node 0 --ranks-per-node 2

Reads the torch.distributed env rendezvous (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) that the
rendered Slurm / Kubernetes jobs set; gloo backend, so it needs no GPU.
"""

from __future__ import annotations

import os
import socket


def main() -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    expected = world * (world + 1) / 2
    ok = x.item() == expected
    print(f"rlpipe smoke: rank {rank}/{world} local_rank {os.environ.get('LOCAL_RANK')} on "
          f"{socket.gethostname()}: all_reduce sum {x.item():g} (expected {expected:g}) {'OK' if ok else 'FAIL'}",
          flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    from rlpipe.stages.common.cli import exit_process

    exit_process(main())
