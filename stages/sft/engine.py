"""DeepSpeed setup for the sft stage: process group, engine, and saving a (possibly ZeRO-3
partitioned) model as a Hugging Face checkpoint.

In-process (one rank, CPU): the gloo process group is initialised here unless another stage in the
same process already did it (RECIPES.md: DS_ACCELERATOR=cpu, LOCAL_RANK=0, a file:// store).
Under torchrun / the deepspeed launcher (RANK and WORLD_SIZE set) it uses the env:// rendezvous.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any


def ensure_distributed() -> tuple[int, int]:
    """Initialise torch.distributed if needed; returns (rank, world_size)."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", "0")
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, init_method="env://")
        else:
            store = Path(tempfile.mkdtemp(prefix="rlpipe-pg-")) / "store"
            dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return dist.get_rank(), dist.get_world_size()


def ds_config(*, batch_size: int, world_size: int, zero_stage: int, grad_clip: float) -> dict[str, Any]:
    """DeepSpeed JSON config: fp32, no gradient accumulation, ZeRO `zero_stage`."""
    if batch_size % world_size:
        raise ValueError(f"batch_size {batch_size} does not divide by the world size {world_size}")
    return {
        "train_batch_size": batch_size,
        "train_micro_batch_size_per_gpu": batch_size // world_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def initialize(model, *, lr: float, weight_decay: float, lr_lambda, config: dict[str, Any]):
    """A DeepSpeed engine around `model` with a torch AdamW (no FusedAdam build on CPU) and a
    LambdaLR schedule that the engine steps after each optimizer step."""
    import deepspeed
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=config)
    return engine


def save_hf(engine, tokenizer, out_dir: Path, *, rank: int, zero_stage: int) -> None:
    """Save the engine's module as a Hugging Face checkpoint (rank 0 writes; ZeRO-3 gathers)."""
    import deepspeed

    module = engine.module
    if zero_stage == 3:
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            if rank == 0:
                _save(module, tokenizer, out_dir)
    elif rank == 0:
        _save(module, tokenizer, out_dir)


def _save(module, tokenizer, out_dir: Path) -> None:
    from rlpipe.stages.common.tiny import save_pretrained

    save_pretrained(module, tokenizer, out_dir)
