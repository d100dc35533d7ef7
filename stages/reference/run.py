"""The reference stage: per-token reference log-probs and critic values of saved rollouts.

The one place for the forward passes that come before advantages (docs/algorithms.md#kl-estimators, #advantage-estimators):
- `ref_logprobs[t] = log pi_ref(a_t | prompt, a_<t)` from a frozen causal LM, through the shared
  `teacher_forced_logprobs` (so they equal the trainer's log-probs of the same model exactly);
- `values[t] = V(prompt, a_<t)`: the critic's head output at position P_b + t - 1 (the state
  before emitting token t), read with `gather_positions`.
Reads a rollouts artifact and writes a `reference` artifact, one shard per rollouts shard with the
same index and row order. Models come from the in-process cache (`load_model`).

Scale-out (as the score stage): worker i of N (worker_index=i, worker_count=N) computes the
rollouts shards k with k % N == i into the shared output directory; the worker that finds every
worker done and every shard present writes the manifest. Batches never cross a shard, so a
shard's bytes do not depend on which worker wrote it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from rlpipe.schemas import (
    REFERENCE,
    ROLLOUTS,
    ArtifactWriter,
    Manifest,
    read_manifest,
    read_shard,
)
from rlpipe.schemas.errors import DataError
from rlpipe.stages.common.forward import (
    batched_packs,
    gather_positions,
    teacher_forced_logprobs,
    unpad,
)
from rlpipe.stages.common.model_loading import compute_dtype
from rlpipe.stages.common.models import load_model
from rlpipe.stages.common.progress import progress
from rlpipe.stages.common.stage_io import StageStart, opens
from rlpipe.stages.common.tables import KEY, list_array_from_numpy, shard_index
from rlpipe.stages.reference.config import ReferenceConfig

COLUMNS = ["run", *KEY, "prompt_token_ids", "response_token_ids"]


@torch.no_grad()
def critic_values(model, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                  pad_id: int, batch_size: int = 32, max_tokens: int | None = None,
                  packing: bool = True) -> list[np.ndarray]:
    """V_t of each response token under a value-head model (no grad), in input order.

    V_t = head(hidden state at P_b + t - 1): the value of the prefix before response token t.
    """
    out: list[np.ndarray] = []
    for batch in batched_packs(model, prompts, responses, pad_id, batch_size, max_tokens, packing):
        head = model(**batch.model_inputs()).logits  # (R, L, 1)
        out.extend(unpad(gather_positions(head[..., 0].float(), batch), batch))
    return out


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _load(path: Path, kind: str, device: torch.device, dtype: str):
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model, tokenizer = load_model(path, kind, dtype=compute_dtype(dtype))
    if next(model.parameters()).device != device:
        model.to(device)  # the cached model moves too: it stays read-only
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return model, pad_id


def _check_vocab(model, prompts: list[list[int]], responses: list[list[int]], where: Path) -> None:
    """Raise naming the first row whose token ids the model's embedding cannot look up."""
    vocab = model.get_input_embeddings().num_embeddings
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        bad = [t for t in p + r if not 0 <= t < vocab]
        if bad:
            raise DataError(f"{where}: row {i} has token id {bad[0]} outside the model's vocabulary "
                             f"(size {vocab}); were the rollouts made with another tokenizer?")


@opens("reference")
def run(config: ReferenceConfig, start: StageStart) -> Manifest:
    """Compute the reference artifact of `config.rollouts`; a cache hit returns the old manifest."""

    device = _device(config.device)
    ref = _load(config.reference_model, "causal", device, config.dtype) if config.reference_model else None
    critic = _load(config.critic, "critic", device, config.dtype) if config.critic else None
    writer = ArtifactWriter(config.output, REFERENCE, stage="reference", config=config.resolved(),
                            inputs=start.inputs, cache_key=start.key, clean=config.worker_index is None)
    listing = read_manifest(config.rollouts)
    names, entries = listing.shard_names, {f.name: f for f in listing.files}  # (every shard checked against one manifest)
    mine = [n for n in names if config.worker_index is None
            or shard_index(Path(n)) % config.worker_count == config.worker_index]
    if config.worker_index is not None:
        writer.prepare_worker(config.worker_index, config.worker_count, others=set(names) - set(mine))
    shards = [(config.rollouts / n, read_shard(config.rollouts / n, ROLLOUTS, columns=COLUMNS, info=entries[n]))
              for n in mine]
    rows = tokens = 0
    with progress(f"reference{config.worker_label()}", sum(t.num_rows for _, t in shards)) as advance:
        for path, table in shards:
            _reference_shard(path, table, ref, critic, writer, config)
            advance(table.num_rows)
            rows += table.num_rows
            tokens += sum(len(r) for r in table.column("response_token_ids").to_pylist())
    extra = {"device": str(device), "ref_logprobs": ref is not None, "values": critic is not None}
    done = {"rows": rows, "response_tokens": tokens, **extra}
    if config.worker_index is None:
        return writer.commit(extra=done, wall_time_s=time.time() - start.started)
    return writer.finish_worker(config.worker_index, config.worker_count, expected=names,
                                commit=lambda: writer.commit(extra=extra, wall_time_s=time.time() - start.started),
                                extra=done)


def _reference_shard(path, table, ref, critic, writer: ArtifactWriter, config: ReferenceConfig) -> None:
    """Reference log-probs and values of one rollouts shard, written as the shard of the same index."""
    prompts = table.column("prompt_token_ids").to_pylist()
    responses = table.column("response_token_ids").to_pylist()
    for model, _ in filter(None, (ref, critic)):
        _check_vocab(model, prompts, responses, path)
    out = {name: table.column(name) for name in ("run", *KEY)}
    out["ref_logprobs"] = (
        list_array_from_numpy(teacher_forced_logprobs(ref[0], prompts, responses, ref[1], config.batch_size,
                                                      max_tokens=config.max_tokens_per_batch, packing=config.packing))
        if ref else [None] * table.num_rows
    )
    out["values"] = (
        list_array_from_numpy(critic_values(critic[0], prompts, responses, critic[1], config.batch_size,
                                            config.max_tokens_per_batch, config.packing))
        if critic else [None] * table.num_rows
    )
    writer.write_shard(out, index=shard_index(path))
