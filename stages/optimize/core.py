"""The optimisation stage's pure core: the per-micro-batch objective and the row schedule.

No IO, no config objects, no process groups: tensors and integers in, tensors and lists out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rlpipe.stages.advantage.kl import kl
from rlpipe.stages.optimize.config import LossConfig, PPOClipLoss
from rlpipe.stages.optimize.losses import agg_loss, policy_loss


@dataclass(frozen=True)
class PolicyObjective:
    """Knobs of L = L_policy + beta * agg(k_x) - c_H * agg(H)."""

    loss: LossConfig = PPOClipLoss()
    """The policy loss L_policy: a config variant (name and knobs), dispatched by `policy_loss`."""
    agg_mode: str = "token-mean"
    kl_estimator: str = "k3"
    kl_beta: float = 0.0
    entropy_coef: float = 0.0


def policy_micro_loss(obj: PolicyObjective, logp: torch.Tensor, old_logp: torch.Tensor,
                      advantages: torch.Tensor, mask: torch.Tensor, *, token_count: float, seq_count: float,
                      max_len: int | None, ref_logp: torch.Tensor | None = None,
                      entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's share of the optimizer step's loss, and its share of each statistic.

    Every term is aggregated with the GLOBAL counts of the step (all micro-batches, all ranks), so
    summing the returned loss over micro-batches and ranks gives the loss of the whole step, and
    likewise every returned statistic sums to its step-wide token mean.

    Args:
        logp: (B, T) differentiable log-probs of the training policy.
        old_logp, advantages, mask: (B, T).
        token_count, seq_count: the step's global token / sequence counts.
        max_len: constant L of seq-mean-token-sum-norm.
        ref_logp: (B, T) reference log-probs; needed when obj.kl_beta > 0.
        entropy: (B, T) per-token entropy H_t; differentiable when obj.entropy_coef > 0.

    Returns:
        (loss, stats): loss a scalar; stats detached scalars named policy_loss, kl_ref, entropy,
        approx_kl, clip_fraction, dual_clip_fraction, ratio_mean.
    """
    out = policy_loss(obj.loss, logp, old_logp, advantages, mask)

    def agg(x: torch.Tensor, mode: str = obj.agg_mode) -> torch.Tensor:
        return agg_loss(x, mask, mode, global_token_count=token_count, global_seq_count=seq_count, max_len=max_len)

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return agg(x.detach(), "token-mean")

    pg = agg(out.loss_mat)
    loss = pg
    stats = {"policy_loss": pg.detach()}
    if ref_logp is not None:
        k = kl(obj.kl_estimator, logp, ref_logp) * mask
        if obj.kl_beta > 0:
            # KL in the loss (GRPO style): + beta * agg(k_x)
            loss = loss + obj.kl_beta * agg(k)
        stats["kl_ref"] = token_mean(k)
    elif obj.kl_beta > 0:
        raise ValueError("kl_beta > 0 needs reference log-probs (ref_logp is None)")
    if entropy is not None:
        if obj.entropy_coef > 0:
            # entropy bonus: - c_H * agg(H_t)
            loss = loss - obj.entropy_coef * agg(entropy)
        stats["entropy"] = token_mean(entropy)
    # approx KL(old || new) with samples from old: k3 with lr = old_logp - logp
    stats["approx_kl"] = token_mean(kl("k3", old_logp, logp.detach()) * mask)
    stats["clip_fraction"] = token_mean(out.clipped)
    stats["dual_clip_fraction"] = token_mean(out.dual_clipped)
    stats["ratio_mean"] = token_mean(out.ratio)
    return loss, stats


def epoch_order(n_rows: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Row order of one epoch: a permutation seeded by (seed, epoch); identity if not shuffling."""
    if not shuffle:
        return np.arange(n_rows)
    return np.random.default_rng([seed, epoch]).permutation(n_rows)


def step_slices(order: np.ndarray, minibatch_size: int, world_size: int, rank: int,
                micro_batch_size: int) -> list[list[np.ndarray]]:
    """This rank's micro-batches (row indices) for each optimizer step of one epoch.

    Minibatch k is order[k*M : (k+1)*M]; rank r takes the contiguous block r of M / W rows and cuts
    it into micro-batches of `micro_batch_size` rows. The partition depends only on (order, M, W),
    so every rank computes the same schedule without communication.

    Returns:
        steps[k][j]: the row indices of micro-batch j of step k on this rank.
    """
    n = len(order)
    per_rank = minibatch_size // world_size
    if n % minibatch_size or minibatch_size % world_size or per_rank % micro_batch_size:
        raise ValueError(
            f"rows {n}, minibatch_size {minibatch_size}, world size {world_size}, micro_batch_size "
            f"{micro_batch_size}: need rows % minibatch_size == 0 and minibatch_size % "
            f"(world_size * micro_batch_size) == 0"
        )
    steps = []
    for start in range(0, n, minibatch_size):
        block = order[start + rank * per_rank: start + (rank + 1) * per_rank]
        steps.append([block[i: i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)])
    return steps
