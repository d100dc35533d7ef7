"""The optimisation stage's pure core: the per-micro-batch objective and the row schedule.

No IO, no config objects, no process groups: tensors and integers in, tensors and lists out.
"""

from __future__ import annotations

import math
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
    kl_clamp: bool = True
    """Clamp k3 (log-ratio to +-20, value to <= 10; stages/advantage/kl.py)."""
    tis_cap: float | None = None
    """C of truncated importance sampling, w_t = min(exp(old_t - rollout_t), C); None: off."""
    mismatch_mask: float | None = None
    """Drop the policy loss of responses with mean_t |old_t - rollout_t| above this; None: off."""


def off_policy_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *,
                       tis_cap: float | None, mismatch_mask: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token weights correcting the rollout engine / trainer mismatch (detached).

        w_t    = min(exp(old_t - rollout_t), C)                 truncated importance sampling
        keep_i = [ sum_t m_t |old_t - rollout_t| / T_i <= tau ]  sequence masking (tau = mismatch_mask)
        weight = w_t * keep_i

    old_t is the trainer's log-prob of the token under the old policy, rollout_t the rollout
    engine's; the samples came from the engine, so w_t reweights them towards the trainer's old
    policy, capped at C to bound the variance.

    Returns:
        (weight, tis_clipped, masked): weight (B, T), zero where masked; tis_clipped (B, T) 1.0
        where exp(old_t - rollout_t) > C; masked (B,) 1.0 for dropped responses.

    Shape:
        old_logp, rollout_logp, mask (B, T).
    """
    m = mask.to(old_logp.dtype)
    diff = (old_logp.detach() - rollout_logp) * m
    ones = torch.ones_like(m)
    w, clipped = ones, torch.zeros_like(m)
    if tis_cap is not None:
        ratio = torch.exp(diff)
        w = torch.clamp(ratio, max=tis_cap)
        clipped = (ratio > tis_cap).to(m.dtype) * m
    masked = torch.zeros(m.shape[0], dtype=m.dtype, device=m.device)
    if mismatch_mask is not None:
        gap = diff.abs().sum(-1) / m.sum(-1).clamp(min=1.0)
        masked = ((gap > mismatch_mask) & (m.sum(-1) > 0)).to(m.dtype)
    return w * (1.0 - masked).unsqueeze(-1) * m, clipped, masked


def policy_micro_loss(obj: PolicyObjective, logp: torch.Tensor, old_logp: torch.Tensor,
                      advantages: torch.Tensor, mask: torch.Tensor, *, token_count: float, seq_count: float,
                      max_len: int | None, ref_logp: torch.Tensor | None = None,
                      entropy: torch.Tensor | None = None,
                      rollout_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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
        rollout_logp: (B, T) the rollout engine's log-probs; needed when obj.tis_cap or
            obj.mismatch_mask is set (off_policy_weights).

    Returns:
        (loss, stats): loss a scalar; stats detached scalars named policy_loss, kl_ref, entropy,
        approx_kl, clip_fraction, dual_clip_fraction, ratio_mean (and with off-policy correction
        tis_weight_mean, tis_clip_fraction, mismatch_masked_fraction).
    """
    out = policy_loss(obj.loss, logp, old_logp, advantages, mask)
    off_policy: dict[str, torch.Tensor] = {}
    if obj.tis_cap is not None or obj.mismatch_mask is not None:
        if rollout_logp is None:
            raise ValueError("tis_cap / mismatch_mask need the rollout log-probs (rollout_logp is None)")
        weight, tis_clipped, masked = off_policy_weights(old_logp, rollout_logp, mask, tis_cap=obj.tis_cap,
                                                         mismatch_mask=obj.mismatch_mask)
        # l_t <- w_t keep_i l_t: the policy-gradient term only (KL and entropy are not samples' returns)
        out = out._replace(loss_mat=out.loss_mat * weight)
        off_policy = {"tis_weight": weight, "tis_clipped": tis_clipped, "masked": masked}

    def agg(x: torch.Tensor, mode: str = obj.agg_mode) -> torch.Tensor:
        return agg_loss(x, mask, mode, global_token_count=token_count, global_seq_count=seq_count, max_len=max_len)

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return agg(x.detach(), "token-mean")

    pg = agg(out.loss_mat)
    loss = pg
    stats = {"policy_loss": pg.detach()}
    if ref_logp is not None:
        k = kl(obj.kl_estimator, logp, ref_logp, clamp=obj.kl_clamp) * mask
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
    if off_policy:
        stats["tis_weight_mean"] = token_mean(off_policy["tis_weight"])
        stats["tis_clip_fraction"] = token_mean(off_policy["tis_clipped"])
        # sequences: sum_i masked_i / S (S the step's global sequence count), adds up over micro-batches
        stats["mismatch_masked_fraction"] = off_policy["masked"].sum() / seq_count
    return loss, stats


def epoch_order(n_rows: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Row order of one epoch: a permutation seeded by (seed, epoch); identity if not shuffling."""
    if not shuffle:
        return np.arange(n_rows)
    return np.random.default_rng([seed, epoch]).permutation(n_rows)


def token_micro_batches(block: np.ndarray, tokens: np.ndarray, parts: int) -> list[np.ndarray]:
    """`block`'s rows in `parts` micro-batches of near-equal token counts: each row, longest
    first, to the micro-batch with the fewest tokens so far (LPT); each micro-batch's rows in
    block order. Deterministic: ties go to the lower index."""
    loads, bins = [0] * parts, [[] for _ in range(parts)]
    for i in sorted(range(len(block)), key=lambda i: (-int(tokens[block[i]]), i)):
        j = min(range(parts), key=lambda j: (loads[j], j))
        loads[j] += int(tokens[block[i]])
        bins[j].append(i)
    return [block[sorted(b)] for b in bins]


def micro_batch_count(block: np.ndarray, tokens: np.ndarray, max_tokens: int, max_rows: int) -> int:
    """The fewest micro-batches `block` splits into (`token_micro_batches`) with at most
    `max_rows` rows and `max_tokens` tokens each (a row longer than the budget alone in its own)."""
    n, total = len(block), int(tokens[block].sum())
    parts = max(1, -(-n // max_rows), -(-total // max_tokens))
    while parts < n:
        cut = token_micro_batches(block, tokens, parts)
        if all(len(m) <= max_rows and (int(tokens[m].sum()) <= max_tokens or len(m) == 1) for m in cut):
            break
        parts += 1
    return min(parts, n)


def step_slices(order: np.ndarray, minibatch_size: int, world_size: int, rank: int,
                micro_batch_size: int, lengths: np.ndarray | None = None,
                max_tokens: int | None = None) -> list[list[np.ndarray]]:
    """This rank's micro-batches (row indices) for each optimizer step of one epoch.

    Minibatch k is order[k*M : (k+1)*M]; rank r takes the contiguous block r of M / W rows and cuts
    it into micro-batches of `micro_batch_size` rows. The partition depends only on (order, M, W),
    so every rank computes the same schedule without communication. With `lengths` (each row's
    padded length), a block's rows are ordered by length before the cut (stable), so the rows a
    micro-batch pads to one length are of similar lengths: the same rows in each step and rank,
    the same step gradient (the loss is split-invariant), less padding.

    With `max_tokens` (each row's token count in `lengths`): a step's blocks are cut by tokens
    instead, into the same number of micro-batches on every rank (the most any rank's block needs
    under `max_tokens` and `micro_batch_size` rows, `micro_batch_count`; ZeRO-3's forward passes are
    collectives), each rank's balanced by tokens (`token_micro_batches`). The step's loss is still
    divided by its global token and sequence counts, so the gradient is the same however cut.

    Returns:
        steps[k][j]: the row indices of micro-batch j of step k on this rank.
    """
    n = len(order)
    per_rank = minibatch_size // world_size
    if max_tokens is not None:
        if lengths is None:
            raise ValueError("a token budget needs each row's length")
        if n % minibatch_size or minibatch_size % world_size:
            raise ValueError(f"rows {n}, minibatch_size {minibatch_size}, world size {world_size}: need rows % "
                             "minibatch_size == 0 and minibatch_size % world_size == 0")
        steps = []
        for start in range(0, n, minibatch_size):
            blocks = [order[start + r * per_rank: start + (r + 1) * per_rank] for r in range(world_size)]
            parts = max(micro_batch_count(b, lengths, max_tokens, micro_batch_size) for b in blocks)
            steps.append(token_micro_batches(blocks[rank], lengths, parts))
        return steps
    if n % minibatch_size or minibatch_size % world_size or per_rank % micro_batch_size:
        raise ValueError(
            f"rows {n}, minibatch_size {minibatch_size}, world size {world_size}, micro_batch_size "
            f"{micro_batch_size}: need rows % minibatch_size == 0 and minibatch_size % "
            f"(world_size * micro_batch_size) == 0"
        )
    steps = []
    for start in range(0, n, minibatch_size):
        block = order[start + rank * per_rank: start + (rank + 1) * per_rank]
        if lengths is not None:
            block = block[np.argsort(lengths[block], kind="stable")]
        steps.append([block[i: i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)])
    return steps


def lr_factor(step: int, schedule: str, *, warmup_steps: int = 0, total_steps: int | None = None,
              min_lr_ratio: float = 0.0) -> float:
    """The LR multiplier of optimizer step `step` (0-based, counted over the whole run).

        warm-up (s < W):  (s + 1) / W
        then, with p = clamp((s - W) / (S - W), 0, 1) and floor m = min_lr_ratio:
            constant  1
            linear    1 - (1 - m) p
            cosine    m + (1 - m) (1 + cos(pi p)) / 2
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if total_steps is None:
        raise ValueError(f"lr_schedule {schedule!r} needs total_steps")
    p = min(max((step - warmup_steps) / max(total_steps - warmup_steps, 1), 0.0), 1.0)
    if schedule == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * p
    if schedule == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"unknown lr_schedule {schedule!r}; known: constant, linear, cosine")
