"""One TRPO step of the policy on a DeepSpeed engine (ZeRO 0 or 1, any world size, fp32 or bf16).

The math is trpo.py's; this module feeds it the engine's forward passes, sums over ranks, and
reads and writes the parameters where the engine keeps them:

- The gradient g and every Fisher-vector product are sums over this rank's micro-batches of
  shares that carry the step's GLOBAL token count, all-reduced over the data-parallel ranks: every
  rank then holds the same g and F v, runs the same conjugate gradient and line search on the
  same numbers, and takes the same step (2 ranks x 4 rows == 1 rank x 8 rows).
- No DeepSpeed forward/backward and no optimizer step: the bare module's forward and
  torch.autograd.grad leave the engine's hooks and gradient buffers alone, and the step is written to the weights the engine's optimizer owns, the fp32
  masters, and from them to the module's (bf16 or fp32) weights, so a train state saved afterwards
  (and DeepSpeed's loading, which restores module weights from the masters) holds the new policy:
    * ZeRO 0, fp32: the module parameters are the masters (torch AdamW steps them in place).
    * ZeRO 0, bf16: DeepSpeed's unfused optimizer keeps an fp32 copy of every parameter
      (`fp32_groups`, paired with `fp16_groups`).
    * ZeRO 1: each rank holds one partition of each group's flat fp32 masters
      (`single_partition_of_fp32_groups`); theta_old is all-gathered from them, and each rank
      writes its own partition back and the whole rounded vector into the module's flat buffer
      (`bit16_groups_flat`, whose views are the module's parameters).
  The step s is computed and applied in fp32 (theta_new = theta_old + f s on the masters), so in
  bf16 a step smaller than the bf16 spacing of a weight still accumulates in its master.
- ZeRO 2 / 3 are refused by the config: they partition the gradients (ZeRO 3 also the
  parameters), while CG needs whole flat gradient and Fisher-vector products on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlpipe.stages.common.forward import PackedBatch, response_entropy, response_logprobs
from rlpipe.stages.optimize.config import TRPOLoss
from rlpipe.stages.optimize.trpo import (
    categorical_kl,
    conjugate_gradient,
    fisher_vector_product,
    flat_grad,
    kl_gradients,
    line_search,
    max_step,
)

MicroLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(logp, entropy) -> the micro-batch's share of the step loss (its other inputs bound)."""


def response_log_softmax(logits: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """log pi(. | prefix) over the vocabulary at each response position, (B, T, V), fp32."""
    return torch.log_softmax(logits[batch.rows.unsqueeze(1), batch.positions].float(), dim=-1)


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x)
    return x


@dataclass
class _Micro:
    batch: PackedBatch
    loss: MicroLoss
    old_log_softmax: torch.Tensor | None = None
    """pi_old over the vocabulary at the response positions (for the line search's KL)."""


class TRPOStep:
    """Collects one optimizer step's micro-batches (`add`), then takes the TRPO step (`step`)."""

    def __init__(self, engine: Any, knobs: TRPOLoss, token_count: float) -> None:
        if engine.zero_optimization_stage() > 1:
            raise ValueError("TRPO needs ZeRO 0 or 1 (whole flat gradients on every rank)")
        self.engine, self.knobs, self.token_count = engine, knobs, token_count
        self.params = [p for p in engine.module.parameters() if p.requires_grad]
        self.grad = torch.zeros(sum(p.numel() for p in self.params), dtype=torch.float32,
                                device=self.params[0].device)
        self.loss_old = torch.zeros((), dtype=torch.float64)
        self.micro: list[_Micro] = []

    def add(self, batch: PackedBatch, loss: torch.Tensor, micro_loss: MicroLoss) -> None:
        """One micro-batch at theta_old: g += grad of its loss share; `micro_loss` recomputes the
        share at trial parameters for the line search."""
        self.grad += flat_grad(loss, self.params)
        self.loss_old += float(loss.detach())
        self.micro.append(_Micro(batch, micro_loss))

    def _logits(self, batch: PackedBatch) -> torch.Tensor:
        # The bare module (whole parameters at ZeRO 0/1): the engine's forward registers output
        # hooks that scale gradients for accumulation and expect engine.backward.
        return self.engine.module(**batch.model_inputs()).logits

    def _kl_terms(self) -> Iterator[torch.Tensor]:
        """Each micro-batch's share of KLbar(old || theta) with pi_old = the current pi, detached
        (value 0, gradient 0, Hessian F at theta_old); keeps pi_old for the line search."""
        for m in self.micro:
            new = response_log_softmax(self._logits(m.batch), m.batch)
            if m.old_log_softmax is None:
                m.old_log_softmax = new.detach()
            yield (categorical_kl(new.detach(), new) * m.batch.mask).sum() / self.token_count

    def _loss_and_kl(self) -> tuple[float, float]:
        """(L, KLbar(pi_old || pi_theta)) at the current parameters, summed over ranks."""
        total = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for m in self.micro:
                logits = self._logits(m.batch)
                logp = response_logprobs(logits, m.batch)
                total[0] += float(m.loss(logp, response_entropy(logits, m.batch)))
                kl = categorical_kl(m.old_log_softmax, response_log_softmax(logits, m.batch)) * m.batch.mask
                total[1] += float(kl.sum()) / self.token_count
        total = _all_reduce(total.to(self.grad.device)).cpu()
        return float(total[0]), float(total[1])

    def step(self) -> dict[str, float]:
        """Take the step (collective: every rank calls); returns its statistics."""
        k = self.knobs
        g = _all_reduce(self.grad)
        loss_old = float(_all_reduce(self.loss_old.to(g.device)))

        # Double backward through attention: the math SDPA kernel is twice differentiable. The
        # KL gradients' graphs are built once and kept for every CG iteration (one double-backward
        # pass per Fisher-vector product instead of a forward and two backward passes).
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            kl_grads = kl_gradients(self._kl_terms(), self.params)

        def fvp(v: torch.Tensor) -> torch.Tensor:
            return fisher_vector_product(kl_grads, self.params, v, damping=k.cg_damping, all_reduce=_all_reduce)

        # x ~ -(F + lambda I)^-1 g: the natural-gradient descent direction of L
        x, iters = conjugate_gradient(fvp, -g, iters=k.cg_iters)
        s = max_step(x, fvp(x), k.max_kl)
        theta_old = read_masters(self.engine, self.params)

        def evaluate(fraction: float) -> tuple[float, float]:
            write_masters(self.engine, self.params, theta_old + fraction * s)
            return self._loss_and_kl()

        result = line_search(evaluate, loss_old, max_kl=k.max_kl, backtrack_ratio=k.backtrack_ratio,
                             steps=k.backtrack_steps)
        kl_grads.clear()  # free the graphs before the next step
        if result.fraction is None:
            write_masters(self.engine, self.params, theta_old)  # no step: back to theta_old exactly
        return {
            "trpo_accepted": float(result.fraction is not None),
            "trpo_step_fraction": result.fraction or 0.0,
            "trpo_backtracks": float(len(result.trials) - (result.fraction is not None)),
            "trpo_kl": result.kl,
            "trpo_loss_improvement": loss_old - result.loss,
            "trpo_expected_improvement": float(-(g @ s)),
            "trpo_cg_iters": float(iters),
            "grad_norm": float(torch.linalg.vector_norm(g)),
        }


# ---------------------------------------------------------------------------------------------
# The engine's fp32 masters, as one flat vector in the order of `params`.
# ---------------------------------------------------------------------------------------------
def _offset(t: torch.Tensor, flat: torch.Tensor) -> int:
    return (t.data_ptr() - flat.data_ptr()) // flat.element_size()


def _zero0_masters(engine: Any, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """ZeRO 0: each parameter's fp32 master (the parameter itself in fp32)."""
    opt = engine.optimizer
    if hasattr(opt, "fp32_groups") and hasattr(opt, "fp16_groups"):  # bf16: the unfused optimizer's copies
        pairs = {id(m): f for mg, fg in zip(opt.fp16_groups, opt.fp32_groups, strict=True)
                 for m, f in zip(mg, fg, strict=True)}
        return [pairs[id(p)] for p in params]
    if any(p.dtype != torch.float32 for p in params):
        raise NotImplementedError(f"TRPO: no fp32 masters found in DeepSpeed's {type(opt).__name__}")
    return list(params)


def read_masters(engine: Any, params: list[torch.Tensor]) -> torch.Tensor:
    """theta: the fp32 masters of `params`, whole, on every rank (ZeRO 1: all-gathered)."""
    opt = engine.optimizer
    if not hasattr(opt, "single_partition_of_fp32_groups"):
        return torch.cat([m.detach().reshape(-1).float() for m in _zero0_masters(engine, params)]).clone()
    where = {}
    for i, flat in enumerate(opt.bit16_groups_flat):
        part = opt.single_partition_of_fp32_groups[i].detach()
        world = len(opt.parallel_partitioned_bit16_groups[i])
        if world > 1:
            parts = [torch.empty_like(part) for _ in range(world)]
            dist.all_gather(parts, part, group=opt.real_dp_process_group[i])
            full = torch.cat(parts)
        else:
            full = part
        for p in opt.bit16_groups[i]:
            where[id(p)] = (full, _offset(p, flat))
    return torch.cat([where[id(p)][0].narrow(0, where[id(p)][1], p.numel()) for p in params]).clone()


def write_masters(engine: Any, params: list[torch.Tensor], theta: torch.Tensor) -> None:
    """Set the fp32 masters to theta and the module's parameters to theta in their dtype."""
    opt = engine.optimizer
    sizes = [p.numel() for p in params]
    values = dict(zip((id(p) for p in params), torch.split(theta, sizes), strict=True))
    with torch.no_grad():
        if not hasattr(opt, "single_partition_of_fp32_groups"):
            for p, master in zip(params, _zero0_masters(engine, params), strict=True):
                v = values[id(p)].view_as(p)
                master.copy_(v)
                if master is not p:
                    p.copy_(v.to(p.dtype))
            return
        for i, flat in enumerate(opt.bit16_groups_flat):
            full = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
            for p in opt.bit16_groups[i]:
                full.narrow(0, _offset(p, flat), p.numel()).copy_(values[id(p)])
            mine = opt.parallel_partitioned_bit16_groups[i][dist.get_rank(group=opt.real_dp_process_group[i])]
            opt.single_partition_of_fp32_groups[i].copy_(full.narrow(0, _offset(mine, flat), mine.numel()))
            flat.copy_(full.to(flat.dtype))
