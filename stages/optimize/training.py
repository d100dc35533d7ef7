"""One optimize run's training: its batch cut into this rank's steps (`prepare`), and the epochs
of minibatch steps on the engines it continues from (`train`), with its metric rows.

Shared by the stage's own run (run.py) and by the replay of earlier runs (replay.py), which rerun
the same steps on the inputs their manifests record: so both live here, below both.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from rlpipe.schemas.errors import UserError
from rlpipe.stages.common.forward import pack, packing_shortens, packs
from rlpipe.stages.common.progress import progress
from rlpipe.stages.optimize.config import OptimizeConfig, TRPOLoss
from rlpipe.stages.optimize.core import (
    PolicyObjective,
    epoch_order,
    policy_micro_loss,
    step_slices,
)
from rlpipe.stages.optimize.data import Batch, load_batch, pad_rows
from rlpipe.stages.optimize.losses import (
    agg_loss,
    clipped_value_loss,
    explained_variance,
    value_moments,
)
from rlpipe.stages.optimize.trpo_step import TRPOStep


@dataclass(eq=False)
class Engines:
    """The policy engine, the critic engine (PPO) or None, and what they are built with and hold."""

    policy: Any
    critic: Any
    knobs: str
    """`engine_knobs` they were built with."""
    rng: torch.Tensor | None = None
    """The stage's torch RNG state that goes with their state (None: seed it from the config)."""

    def roles(self) -> dict[str, Any]:
        return {"policy": self.policy, **({"critic": self.critic} if self.critic is not None else {})}

    def destroy(self) -> None:
        for engine in self.roles().values():
            engine.destroy()


@dataclass
class Work:
    """One optimize run's batch and how it is cut into steps."""

    batch: Batch
    schedules: list
    """Per epoch, per optimizer step, this rank's micro-batches (row indices)."""
    dscfg: dict[str, Any]
    """The DeepSpeed config (its gradient accumulation follows from the batch)."""
    max_len: int


def prepare(config: OptimizeConfig, d: Any) -> Work:
    """Load the batch of `config`'s run and cut it into this rank's steps."""
    from rlpipe.stages.common import deepspeed as ds

    batch = load_batch(config.rollouts, config.advantages, config.reference,
                       need_ref=config.kl_beta > 0 and config.lora is None, need_values=config.critic is not None)
    n = len(batch)
    minibatch = config.minibatch_size or n
    # A micro-batch bounds memory: one larger than a rank's share of a step is that share (a small
    # iteration, 2 prompts x 2 samples, under the default of 8).
    micro = min(config.micro_batch_size, max(minibatch // d.world_size, 1))
    by_tokens = config.max_tokens_per_micro_batch
    lengths = batch.sequence_lengths() if config.group_by_length or by_tokens else None
    try:
        schedules = [step_slices(epoch_order(n, config.seed, e, config.shuffle), minibatch, d.world_size, d.rank,
                                 micro, lengths, by_tokens) for e in range(config.epochs)]
    except ValueError as e:
        raise UserError(f"optimize cannot cut the iteration's rows into steps: {e}; set optimize.minibatch_size "
                        "and optimize.micro_batch_size to divide them (prompts_per_iteration x rollout.group_size "
                        "rows, split over the optimize ranks)") from None
    grad_accum = minibatch // (d.world_size * micro)
    if by_tokens:  # (micro-batches per step vary: each step's last one is marked as its boundary, `_train_step`)
        micro, grad_accum = minibatch // d.world_size, 1
    dscfg = ds.ds_config(config.zero_stage, micro_batch_size=micro, grad_accum=grad_accum,
                         world_size=d.world_size, grad_clip=config.grad_clip, bf16=ds.use_bf16(config.dtype),
                         offload_optimizer=config.offload_optimizer, offload_params=config.offload_params)
    # seq-mean-token-sum-norm's L: the most tokens one response of the batch sampled (an episode's
    # environment tokens are not trained on, so they do not count in L either).
    return Work(batch, schedules, dscfg, config.max_len or int(batch.sampled_lengths().max()))


def train(E: Any, config: OptimizeConfig, work: Work, engines: Engines, pad_id: int, world_size: int,
          timing: dict[str, float]) -> list[tuple[int, str, float]]:
    """`config`'s optimize steps on `engines` (which then hold the state after them, RNG included);
    returns the metric rows."""
    batch, pol = work.batch, engines.policy
    if config.lora is not None and batch.ref_logp is None and config.kl_beta > 0:
        from rlpipe.stages.optimize.lora import adapters_disabled

        # The reference of a LoRA run is its base: the same model with the adapters off (no copy).
        with adapters_disabled(pol):
            ref = _recompute_old_logprobs(E, pol, batch, work.schedules[0], pad_id, world_size,
                                          config.logprob_chunk_tokens, _packing(config, batch, pol))
        batch.ref_logp = [ref[i] for i in range(len(batch))]
    # The stage's torch RNG is the train state's (seeded on a fresh start), forked so that the
    # stages around it in one process see the global RNG as if optimize had not run.
    with torch.random.fork_rng(devices=[]):
        if engines.rng is None:
            torch.manual_seed(config.seed)
        else:
            torch.set_rng_state(engines.rng)
        rows, step, stopped = _optimize(E, config, batch, work.schedules, pol, engines.critic, pad_id, work.max_len,
                                        world_size, timing)
        engines.rng = torch.get_rng_state()
    return [*rows, (0, "steps", float(step)), (0, "early_stopped", float(stopped))]


def _optimize(E: Any, config: OptimizeConfig, batch: Batch, schedules: list, pol: Any, crit: Any, pad_id: int,
              max_len: int, world_size: int, timing: dict[str, float]) -> tuple[list, int, bool]:
    """The epochs of minibatch steps; returns (metric rows, steps taken, early-stopped?)."""
    # Old log-probs (recompute_old_logprobs): those of the first step's rows come from that step's
    # own training forward (detached: before the first update the policy is the input policy, so
    # they are the same numbers a separate forward gives); the other rows' from a no-grad forward
    # of the input policy now, on exactly the micro-batches of epoch 0 (same packing, no dropout).
    mark = time.perf_counter()
    old_logp: dict[int, np.ndarray] = {}
    if not config.recompute_old_logprobs:
        old_logp = dict(enumerate(batch.rollout_logp))
    else:
        first = 1 if config.old_logprobs_forward == "training" else 0
        old_logp = _recompute_old_logprobs(E, pol, batch, schedules[0][first:], pad_id, world_size,
                                           config.logprob_chunk_tokens, _packing(config, batch, pol))
    timing["old_logprobs_s"] = time.perf_counter() - mark

    obj = PolicyObjective(loss=config.loss, agg_mode=config.agg_mode, kl_estimator=config.kl_estimator,
                          kl_beta=config.kl_beta, entropy_coef=config.entropy_coef, kl_clamp=config.kl_clamp,
                          tis_cap=config.tis_cap, mismatch_mask=config.mismatch_mask)
    step, stopped, rows = 0, False, []
    total_steps = sum(len(s) for s in schedules)
    mark, trained_tokens = time.perf_counter(), 0.0
    with progress("optimize", total_steps, enabled=torch.distributed.get_rank() == 0) as advance:
        for epoch, steps in enumerate(schedules):
            for micro_batches in steps:
                step += 1
                stats = _train_step(E, pol, crit, batch, micro_batches, old_logp, obj, config, pad_id, max_len)
                if step == 1 and len(old_logp) < len(batch):
                    old_logp = E.gather_rows(old_logp, world_size)  # every rank's first-step rows
                stats["epoch"] = float(epoch)
                rows += [(step, name, value) for name, value in sorted(stats.items())]
                trained_tokens += stats["tokens"]
                advance(loss=stats["loss"], approx_kl=stats["approx_kl"])
                if config.kl_target is not None and stats["approx_kl"] > config.kl_target:
                    stopped = True
                    break
            if stopped:
                break
    # Timings go to the manifests' `extra` (not the metrics table, whose content hash is reproducible).
    timing["loop_s"] = time.perf_counter() - mark
    timing["tokens_per_s"] = trained_tokens / timing["loop_s"]
    return _batch_metrics(batch, old_logp, config.recompute_old_logprobs) + rows, step, stopped


def _recompute_old_logprobs(E: Any, engine: Any, batch: Batch, steps: list, pad_id: int,
                            world_size: int, chunk_tokens: int | None, packing: bool) -> dict[int, np.ndarray]:
    local: dict[int, np.ndarray] = {}
    with torch.no_grad():
        for micro_batches in steps:
            for rows in micro_batches:
                packed = _pack(E, batch, rows, pad_id, packing)
                logp = E.policy_logprobs(engine, packed, chunk_tokens=chunk_tokens).cpu().numpy()
                for b, i in enumerate(rows):
                    local[int(i)] = logp[b, : len(batch.response_ids[i])].copy()
    return E.gather_rows(local, world_size)


def _packing(config: OptimizeConfig, batch: Batch, *models: Any) -> bool:
    """Whether the batch's passes are packed: `config.packing`, every model takes it, and it
    shortens the batch (decided for the whole batch: the layout of a row never depends on how the
    step is split into ranks and micro-batches)."""
    return (config.packing and all(packs(m) for m in models if m is not None)
            and packing_shortens(batch.sequence_lengths().tolist()))


def _pack(E: Any, batch: Batch, rows: np.ndarray, pad_id: int, packed: bool):
    return pack([batch.prompt_ids[i] for i in rows], [batch.response_ids[i] for i in rows], pad_id,
                sampled=batch.sampled_rows(rows), packed=packed).to(E.device())


def _train_step(E: Any, pol: Any, crit: Any, batch: Batch, micro_batches: list[np.ndarray],
                old_logp: dict[int, np.ndarray], obj: PolicyObjective, config: OptimizeConfig,
                pad_id: int, max_len: int) -> dict[str, float]:
    """One optimizer step of the policy (and critic) over this rank's micro-batches."""
    dev = E.device()
    lengths = batch.sampled_lengths(np.concatenate(micro_batches))
    # The step's global token and sequence counts, all-reduced before any backward pass: every
    # micro-batch's loss is divided by them, so the step's gradient is split-invariant.
    counts = E.all_reduce(torch.tensor([lengths.sum(), (lengths > 0).sum()], dtype=torch.float64, device=dev))
    n_tok, n_seq = float(counts[0]), float(counts[1])
    sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64, device=dev))
    lo = torch.tensor(float("inf"), dtype=torch.float64, device=dev)
    hi = torch.tensor(float("-inf"), dtype=torch.float64, device=dev)
    moments = torch.zeros(5, dtype=torch.float64, device=dev)
    world = torch.distributed.get_world_size()
    norms: dict[str, float | None] = {}
    lr = float(pol.optimizer.param_groups[0]["lr"])  # this step's (the engine steps the schedule after it)
    # TRPO (trpo_step.py) takes the policy step itself after the micro-batches: no AdamW step
    trpo = TRPOStep(pol, config.loss, n_tok) if isinstance(config.loss, TRPOLoss) else None
    off_policy = config.tis_cap is not None or config.mismatch_mask is not None
    packing = _packing(config, batch, pol, crit)
    for j, rows in enumerate(micro_batches):
        if config.max_tokens_per_micro_batch:  # (a step's micro-batches vary in number: its last is the boundary)
            for engine in (pol, crit):
                if engine is not None and trpo is None:
                    engine.set_gradient_accumulation_boundary(j == len(micro_batches) - 1)
        packed = _pack(E, batch, rows, pad_id, packing)
        T = packed.mask.shape[1]
        # TRPO differentiates the bare module (the engine's forward hooks expect engine.backward)
        logp, entropy = E.policy_forward(pol if trpo is None else pol.module, packed, entropy_grad=obj.entropy_coef > 0,
                                         chunk_tokens=config.logprob_chunk_tokens)
        if rows[0] in old_logp:
            old = pad_rows(old_logp, rows, T).to(dev)
        else:  # first step, before any update: the old log-probs are this forward's (detached)
            old = logp.detach().float() * packed.mask
            old_logp.update({int(i): old[b, : len(batch.response_ids[i])].cpu().numpy() for b, i in enumerate(rows)})
        ref = pad_rows(batch.ref_logp, rows, T).to(dev) if batch.ref_logp is not None else None
        rollout = pad_rows(batch.rollout_logp, rows, T).to(dev) if off_policy else None
        micro_loss = partial(policy_micro_loss, obj, old_logp=old, advantages=pad_rows(batch.advantages, rows, T).to(dev),
                             mask=packed.mask, token_count=n_tok, seq_count=n_seq, max_len=max_len, ref_logp=ref,
                             rollout_logp=rollout)
        loss, stats = micro_loss(logp, entropy=entropy)
        if trpo is not None:
            trpo.add(packed, loss, lambda lp, h, f=micro_loss: f(lp, entropy=h)[0])
        else:
            E.backward_step(pol, loss, world)
            norms["grad_norm"] = E.optimizer_step(pol)
        sums["loss"] += loss.detach().double()
        for name, value in stats.items():
            sums[name] += value.double()
        ratio = torch.exp(logp.detach() - old).double()
        on = packed.mask > 0
        lo = torch.minimum(lo, torch.where(on, ratio, torch.inf).min())
        hi = torch.maximum(hi, torch.where(on, ratio, -torch.inf).max())
        if crit is not None:
            values = E.critic_values(crit, packed)
            returns = pad_rows(batch.returns, rows, T).to(dev)
            vl = clipped_value_loss(values, pad_rows(batch.values, rows, T).to(dev), returns, packed.mask,
                                    clip_eps=config.value_clip)
            vloss = agg_loss(vl.loss_mat, packed.mask, "token-mean", global_token_count=n_tok)
            E.backward_step(crit, config.value_coef * vloss, world)
            norms["critic_grad_norm"] = E.optimizer_step(crit)
            sums["value_loss"] += vloss.detach().double()
            sums["value_clip_fraction"] += agg_loss(vl.clipped, packed.mask, "token-mean", global_token_count=n_tok).double()
            moments += value_moments(values, returns, packed.mask)
    if trpo is not None:
        norms.update(trpo.step())
    names = sorted(sums)
    totals = E.all_reduce(torch.stack([sums[k] for k in names]))
    out = {k: float(v) for k, v in zip(names, totals, strict=False)}
    out["ratio_min"], out["ratio_max"] = float(E.all_reduce(lo, "min")), float(E.all_reduce(hi, "max"))
    out.update({k: float(v) for k, v in norms.items() if v is not None})
    out["lr"] = lr
    out["tokens"] = n_tok
    if crit is not None:
        out["explained_variance"] = explained_variance(E.all_reduce(moments))
    return out


def _batch_metrics(batch: Batch, old_logp: dict[int, np.ndarray], recomputed: bool) -> list[tuple[int, str, float]]:
    """Once-per-stage metrics (step 0): lengths, rewards, truncation, zero-variance groups, log-prob gap."""
    lengths = batch.sampled_lengths()
    groups: dict[int, list[float]] = defaultdict(list)
    for g, r in zip(batch.group_id.tolist(), batch.reward.tolist(), strict=False):
        groups[g].append(r)
    rows = [
        (0, "rows", float(len(batch))),
        (0, "response_length_mean", float(lengths.mean())),
        (0, "response_length_max", float(lengths.max())),
        (0, "reward_mean", float(batch.reward.mean())),
        (0, "reward_std", float(batch.reward.std())),
        (0, "truncated_fraction", float(batch.truncated.mean())),
        (0, "zero_variance_group_fraction", float(np.mean([max(v) == min(v) for v in groups.values()]))),
    ]
    if recomputed:
        # rollout engine vs trainer log-probs of the same tokens (numerics, sampling processing)
        gap = np.concatenate([np.abs(batch.rollout_logp[i] - old_logp[i])[batch.sampled[i] > 0] if batch.sampled
                              else np.abs(batch.rollout_logp[i] - old_logp[i]) for i in range(len(batch))])
        rows += [(0, "logprob_gap_mean_abs", float(gap.mean()) if gap.size else 0.0),
                 (0, "logprob_gap_max_abs", float(gap.max()) if gap.size else 0.0)]
    return rows
