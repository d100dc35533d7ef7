"""DeepSpeed plumbing of the optimisation stage: process group, engines, forward passes, saving.

Repeatable in one process: the process group is created once (gloo on CPU when none exists) and
kept; every `run()` builds fresh engines and destroys them at the end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlpipe.stages.common.forward import (
    PackedBatch,
    gather_positions,
    response_entropy,
    response_logprobs,
)

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402  (after DS_ACCELERATOR)

logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int


def ensure_process_group() -> Dist:
    """Join the launcher's process group (torchrun / deepspeed set RANK), or create a 1-rank gloo
    group on a file store; an existing group is reused (in-process runner, tests)."""
    if not dist.is_initialized():
        os.environ.setdefault("LOCAL_RANK", "0")
        if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend)
        else:
            store = os.path.join(tempfile.mkdtemp(prefix="rlpipe-pg-"), "store")
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    return Dist(dist.get_rank(), dist.get_world_size())


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def use_bf16(dtype: str) -> bool:
    return dtype == "bf16" or (dtype == "auto" and torch.cuda.is_available())


def ds_config(zero_stage: int, *, micro_batch_size: int, grad_accum: int, world_size: int, grad_clip: float,
              bf16: bool) -> dict[str, Any]:
    """The zero<stage>.json template with its "auto" fields filled."""
    from rlpipe.cluster.launch import deepspeed_template

    cfg = deepspeed_template(zero_stage)
    cfg["train_micro_batch_size_per_gpu"] = micro_batch_size
    cfg["gradient_accumulation_steps"] = grad_accum
    cfg["train_batch_size"] = micro_batch_size * grad_accum * world_size
    cfg["gradient_clipping"] = grad_clip
    cfg["bf16"] = {"enabled": bf16}
    return cfg


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off in train mode too: the recomputed old log-probs and the first training forward
    must be the same function (ratio exactly 1), and PPO's ratio must not see dropout noise."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop"):
        if isinstance(model.config.to_dict().get(key), float):
            setattr(model.config, key, 0.0)
    for module in model.modules():
        # Functional dropout rates kept on modules: Llama-style `attention_dropout`, OPT's `dropout`
        # and `layerdrop` (its decoder layers call F.dropout(p=self.dropout), no nn.Dropout).
        for key in ("attention_dropout", "dropout", "layerdrop"):
            if isinstance(vars(module).get(key), float):
                setattr(module, key, 0.0)


def make_engine(model: torch.nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                config: dict[str, Any], gradient_checkpointing: bool) -> Any:
    """A DeepSpeed engine around `model` with a fresh torch AdamW (no FusedAdam build on CPU)."""
    disable_dropout(model)
    if gradient_checkpointing:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()

    def adamw(params):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)

    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      optimizer=adamw, config=config)
    return engine


def forward_logits(engine: Any, batch: PackedBatch) -> torch.Tensor:
    return engine(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits


def policy_forward(engine: Any, batch: PackedBatch, *, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy), both (B, T); entropy carries gradient only when `entropy_grad`."""
    logits = forward_logits(engine, batch)
    logp = response_logprobs(logits, batch)
    if entropy_grad:
        return logp, response_entropy(logits, batch)
    with torch.no_grad():
        return logp, response_entropy(logits.detach(), batch)


def critic_values(engine: Any, batch: PackedBatch) -> torch.Tensor:
    """V_t read at position P_b + t - 1 (the state before response token t): (B, T)."""
    return gather_positions(forward_logits(engine, batch)[..., 0].float(), batch)


def backward_step(engine: Any, loss: torch.Tensor, world_size: int) -> None:
    """Backward of one micro-batch's share of the step loss, scaled for DeepSpeed.

    `loss` already carries the step's global denominators (sum over micro-batches m and ranks r of
    loss_{r,m} is the step loss L). DeepSpeed's engine.backward divides by gas (the gradient
    accumulation steps) and its all-reduce averages over the W ranks, so it produces
        g = (1/W) * sum_r sum_m grad(x_{r,m} / gas).
    Passing x_{r,m} = W * gas * loss_{r,m} gives g = sum_r sum_m grad(loss_{r,m}) = grad L exactly,
    independent of how the step's rows are split into ranks and micro-batches.
    """
    engine.backward(loss * (world_size * engine.gradient_accumulation_steps()))


def optimizer_step(engine: Any) -> float | None:
    """engine.step(); at the accumulation boundary returns the global grad norm (before clipping)."""
    boundary = engine.is_gradient_accumulation_boundary()
    norm = None
    if boundary and engine.zero_optimization_stage() == 0 and not engine.bfloat16_enabled():
        # ZeRO 0 in fp32 does not report the norm: gradients are already all-reduced here.
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))
    engine.step()
    if boundary and norm is None:
        got = engine.get_global_grad_norm()
        norm = float(got) if got is not None else float("nan")
    return norm


@contextlib.contextmanager
def full_parameters(engine: Any) -> Iterator[torch.nn.Module]:
    """The engine's module with every parameter whole (ZeRO-3 gathers them; collective)."""
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
            yield engine.module
    else:
        yield engine.module


def save_module(engine: Any, tokenizer: Any, out_dir: Any, rank: int) -> torch.nn.Module | None:
    """Save the full model + tokenizer (rank 0) in Hugging Face format; collective under ZeRO-3.

    Returns, on rank 0, a plain copy of the trained model in eval mode (no DeepSpeed hooks), equal
    to what loading `out_dir` gives; None on other ranks.
    """
    copy = None
    with full_parameters(engine) as module:
        if rank == 0:
            module.save_pretrained(out_dir, safe_serialization=True)
            tokenizer.save_pretrained(out_dir)
            copy = type(module)(module.config)
            copy.load_state_dict({k: v.detach().clone() for k, v in module.state_dict().items()})
            if module.can_generate():
                copy.generation_config = module.generation_config
            copy.eval()
    return copy


def gather_rows(local: dict[int, Any], world_size: int) -> dict[int, Any]:
    """Union of every rank's {row: value} dicts (all ranks get all rows)."""
    if world_size == 1:
        return dict(local)
    parts: list[dict[int, Any]] = [{} for _ in range(world_size)]
    dist.all_gather_object(parts, local)
    out: dict[int, Any] = {}
    for p in parts:
        out.update(p)
    return out


def all_reduce(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce over the world (sum | min | max); a no-op with one rank."""
    if dist.get_world_size() > 1:
        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        dist.all_reduce(x, op=ops[op])
    return x
