"""DeepSpeed side of the optimisation stage: engines, forward passes, steps, collectives.

The process group, the DeepSpeed config and saving are stages/common's (distributed, deepspeed).
Repeatable in one process: the process group is created once and kept; engines are built per
`run()` or kept warm for the next one (run.py, keyed by the train state they hold).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rlpipe.stages.common.deepspeed import make_engine as common_make_engine
from rlpipe.stages.common.forward import PackedBatch, gather_positions, response_stats


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


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
                config: dict[str, Any], gradient_checkpointing: bool,
                lr_lambda: Callable[[int], float] | None = None) -> Any:
    """A DeepSpeed engine around `model` with a fresh torch AdamW (no FusedAdam build on CPU) and
    a LambdaLR schedule `lr_lambda` (the engine steps it once per optimizer step)."""
    disable_dropout(model)
    if gradient_checkpointing:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()

    def adamw(params):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)

    return common_make_engine(model, config, optimizer=adamw, lr_lambda=lr_lambda)


def forward_logits(engine: Any, batch: PackedBatch) -> torch.Tensor:
    return engine(**batch.model_inputs()).logits


def policy_forward(engine: Any, batch: PackedBatch, *, entropy_grad: bool,
                   chunk_tokens: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy), both (B, T); entropy carries gradient only when `entropy_grad`; the logits
    `chunk_tokens` response tokens at a time (`forward.response_stats`)."""
    return response_stats(engine, batch, chunk_tokens=chunk_tokens, entropy_grad=entropy_grad)


def policy_logprobs(engine: Any, batch: PackedBatch, *, chunk_tokens: int | None) -> torch.Tensor:
    """logp (B, T), no entropy (nothing reads it: the old log-probs' pass)."""
    return response_stats(engine, batch, chunk_tokens=chunk_tokens, entropy=False)[0]


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
