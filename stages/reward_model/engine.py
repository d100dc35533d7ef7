"""DeepSpeed side of the reward-model stage: model loading, training, evaluation.

Runs in one process on CPU (gloo, fp32) or under `torchrun` / `deepspeed` with several ranks:
every rank reads the same pairs, takes its slice of each global batch, and evaluates the whole
held-out set (so ZeRO-3's collective parameter gathers stay in step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rlpipe.stages.common.forward import packs
from rlpipe.stages.common.progress import progress
from rlpipe.stages.reward_model.config import RewardModelConfig
from rlpipe.stages.reward_model.core import epoch_batches
from rlpipe.stages.reward_model.loss import bradley_terry_loss
from rlpipe.stages.reward_model.modeling import (
    RewardCheckpointError,
    RewardModule,
    reward_batch,
)


def load_base(path: Path, seed: int):
    """(model, tokenizer): a reward `ScalarHeadModel` built from `path`, any architecture.

    A causal-LM checkpoint gets a fresh head (N(0, 1 / (H + 1)^2), seeded by `seed`); a reward
    checkpoint (rlpipe scalar head, or a 1-label sequence-classification model) keeps its head.
    """
    from transformers.utils import logging as hf_logging

    from rlpipe.stages.common.scalar_head import ScalarHeadCheckpointError, load_scalar_head_model
    from rlpipe.stages.common.tiny import load_tokenizer

    if not (path / "config.json").is_file():
        raise RewardCheckpointError(f"base checkpoint {path} does not exist or has no config.json")
    hf_logging.disable_progress_bar()
    try:
        model = load_scalar_head_model(path, "reward", new_head="normal", seed=seed)
    except ScalarHeadCheckpointError as e:
        raise RewardCheckpointError(f"base checkpoint: {e}") from None
    return model, load_tokenizer(path)


@dataclass
class PairData:
    """Tokenised pairs: chosen/rejected token ids and margins (0 where absent)."""

    chosen: list[list[int]]
    rejected: list[list[int]]
    margin: np.ndarray

    def take(self, idx: np.ndarray) -> PairData:
        return PairData([self.chosen[i] for i in idx], [self.rejected[i] for i in idx], self.margin[idx])

    def __len__(self) -> int:
        return len(self.chosen)


@dataclass
class History:
    """Metrics rows as (step, name, value)."""

    rows: list[tuple[int, str, float]] = field(default_factory=list)

    def log(self, step: int, **values: float) -> None:
        self.rows.extend((step, k, float(v)) for k, v in values.items())


def _forward_pairs(engine, data: PairData, pad_id: int, packing: bool):
    """(r_chosen, r_rejected) of the pairs: one forward over both sides, packed where it may be."""
    b = len(data)
    packed = packing and packs(engine.module.model)
    r = engine(**reward_batch(data.chosen + data.rejected, pad_id, packed, engine.device))
    return r[:b], r[b:]


@torch.no_grad()
def evaluate(engine, data: PairData, pad_id: int, cfg: RewardModelConfig) -> dict[str, float]:
    """Held-out pairwise accuracy, BT loss (margin included) and reward statistics."""
    engine.eval()
    rc, rr = [], []
    for start in range(0, len(data), cfg.eval_batch_size):
        c, r = _forward_pairs(engine, data.take(np.arange(start, min(start + cfg.eval_batch_size, len(data)))), pad_id,
                              cfg.packing)
        rc.append(c.float().cpu())
        rr.append(r.float().cpu())
    engine.train()
    r_c, r_r = torch.cat(rc), torch.cat(rr)
    margin = torch.as_tensor(data.margin, dtype=torch.float32) if cfg.use_margin else None
    _, stats = bradley_terry_loss(r_c, r_r, margin)
    both = torch.cat([r_c, r_r])
    return {
        "eval_loss": stats["bt_loss"],
        "eval_accuracy": stats["accuracy"],
        "eval_reward_mean": float(both.mean()),
        "eval_reward_std": float(both.std(unbiased=False)),
        "eval_reward_chosen_mean": stats["reward_chosen"],
        "eval_reward_rejected_mean": stats["reward_rejected"],
    }


def train(model, tokenizer, train_data: PairData, eval_data: PairData, cfg: RewardModelConfig,
          rank: int, world_size: int):
    """Train with DeepSpeed; returns (engine, history). Loss per optimizer step, held-out metrics
    after every epoch (step = optimizer steps so far)."""
    import torch.distributed as dist

    from rlpipe.stages.common.deepspeed import ds_config, make_engine

    config = ds_config(cfg.zero_stage, micro_batch_size=cfg.batch_size, grad_accum=cfg.gradient_accumulation,
                       world_size=world_size, grad_clip=cfg.grad_clip)
    engine = make_engine(RewardModule(model), config, optimizer=lambda params: torch.optim.AdamW(
        params, lr=cfg.lr, weight_decay=cfg.weight_decay))
    engine.train()
    pad_id = tokenizer.pad_token_id
    history = History()
    step, acc = 0, []
    epochs = [epoch_batches(len(train_data), cfg.batch_size, e, cfg.seed, rank, world_size)
              for e in range(cfg.epochs)]
    total = sum(len(b) for b in epochs)
    with progress("reward_model", total, enabled=rank == 0) as advance:
        for batches in epochs:
            for idx in batches:
                batch = train_data.take(idx)
                r_c, r_r = _forward_pairs(engine, batch, pad_id, cfg.packing)
                margin = torch.as_tensor(batch.margin, dtype=torch.float32) if cfg.use_margin else None
                loss, stats = bradley_terry_loss(r_c, r_r, margin, cfg.center_coef)
                engine.backward(loss)
                boundary = engine.is_gradient_accumulation_boundary()
                engine.step()
                acc.append([float(loss.detach()), stats["accuracy"], stats["reward_margin"]])
                advance(loss=acc[-1][0])
                if boundary:
                    step += 1
                    mean = torch.tensor(acc, dtype=torch.float64).mean(0)
                    if world_size > 1:
                        dist.all_reduce(mean)
                        mean /= world_size
                    history.log(step, loss=mean[0], accuracy=mean[1], reward_margin=mean[2])
                    acc = []
            if len(eval_data):
                history.log(step, **evaluate(engine, eval_data, pad_id, cfg))
    return engine, history
