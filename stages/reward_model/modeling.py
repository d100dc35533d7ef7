"""The reward of a (prompt, response) under a scalar-head model: tokenising, padding, reading
the head at the last real token. Shared by training (this stage) and scoring (`score` stage).

Sequences are `tokenizer(prompt + response)` (the tokenizer adds BOS if it does), cut to their
last `max_length` tokens, **right-padded**, and the head is read at index `len - 1` taken from
the attention mask. This does not rely on the pad token id differing from every real token (HF's
own pooling looks for the rightmost non-pad id, which breaks when pad == eos).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from rlpipe.stages.common.forward import forward_batches, packs


class RewardCheckpointError(ValueError):
    """A checkpoint is missing or is not a reward model (a scalar-head model with one output)."""


def num_labels(cfg: dict) -> int:
    """Label count of a config.json dict (`id2label` is what transformers saves; default 2)."""
    return int(cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2)


def check_reward_checkpoint(path: Path | str, what: str = "reward model") -> None:
    """Raise RewardCheckpointError unless `path` holds a reward model: an rlpipe scalar-head
    reward model (scalar_head.py) or a 1-label `*ForSequenceClassification` model."""
    from rlpipe.stages.common.scalar_head import read_kind

    path = Path(path)
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise RewardCheckpointError(f"{what} checkpoint {path} does not exist")
    if not cfg_file.is_file():
        raise RewardCheckpointError(f"{what} checkpoint {path} has no config.json (not a Hugging Face model)")
    cfg = json.loads(cfg_file.read_text())
    kind = read_kind(path)
    if kind != "reward":
        described = {"causal": cfg.get("architectures"), "critic": "critic (value model)"}.get(kind, kind)
        raise RewardCheckpointError(
            f"{what} checkpoint {path} is a {described}, not a sequence-classification reward model "
            "nor an rlpipe scalar-head one (train one with the reward_model stage)"
        )
    n_labels = num_labels(cfg)
    if "rlpipe_scalar_head" not in cfg and n_labels != 1:
        raise RewardCheckpointError(
            f"{what} checkpoint {path} has a {n_labels}-label head; a reward model has exactly 1 label"
        )


def encode(tokenizer, prompts: Sequence[str], responses: Sequence[str], max_length: int) -> list[list[int]]:
    """Token ids of prompt + response for each pair, keeping the last `max_length` tokens."""
    texts = [p + r for p, r in zip(prompts, responses, strict=True)]
    ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
    return [list(x[-max_length:]) for x in ids]


def right_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, L) long, sequences left-aligned and right-padded."""
    if any(len(s) == 0 for s in seqs):
        raise ValueError("an empty token sequence has no last token to read a reward from")
    L = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for b, s in enumerate(seqs):
        input_ids[b, : len(s)] = torch.tensor(list(s), dtype=torch.long)
        attention_mask[b, : len(s)] = 1
    return input_ids, attention_mask


def sequence_rewards(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                     ends: torch.Tensor | None = None) -> torch.Tensor:
    """Scalar reward of each sequence: the head at its last real token.

    `model` is a `ScalarHeadModel` (one output per position, scalar_head.py). Right-padded rows
    (`attention_mask`): r[b] = head(h[b, len_b - 1]), len_b = attention_mask[b].sum(). Packed rows
    (`position_ids`, `reward_batch`): r[b] = head(h[rows[b], ends[b]]).

    Shape:
        input_ids, attention_mask, position_ids: (R, L); rows, ends: (B,). Returns (B,) float.
    """
    if position_ids is not None:
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[..., 0]  # (R, L)
        return out[rows, ends].float()
    out = model(input_ids=input_ids, attention_mask=attention_mask).logits[..., 0]  # (B, L)
    last = attention_mask.sum(dim=1) - 1  # right padding: the last real token sits at len - 1
    return out[torch.arange(out.shape[0], device=out.device), last].float()


def reward_batch(seqs: Sequence[Sequence[int]], pad_id: int, packed: bool,
                 device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """`sequence_rewards`' keyword arguments for `seqs`: right-padded rows, or (`packed`, where
    the architecture takes it: forward.packs) the sequences back to back (forward.PackedRows)."""
    if not packed:
        input_ids, attention_mask = right_pad(seqs, pad_id)
        return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
    from rlpipe.stages.common.forward import PackedRows

    if any(len(s) == 0 for s in seqs):
        raise ValueError("an empty token sequence has no last token to read a reward from")
    rows = PackedRows(seqs, pad_id)
    ends = [start + len(s) - 1 for start, s in zip(rows.start_of, seqs, strict=True)]
    return {"input_ids": rows.input_ids.to(device), "position_ids": rows.position_ids.to(device),
            "rows": torch.tensor(rows.row_of, device=device), "ends": torch.tensor(ends, device=device)}


class RewardModule(torch.nn.Module):
    """Wraps a `ScalarHeadModel` so DeepSpeed's forward is `sequence_rewards`."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                ends: torch.Tensor | None = None) -> torch.Tensor:
        return sequence_rewards(self.model, input_ids, attention_mask, position_ids, rows, ends)


@torch.no_grad()
def score_texts(model, tokenizer, prompts: Sequence[str], responses: Sequence[str], *,
                max_length: int, batch_size: int, max_tokens: int | None = None,
                packing: bool = True) -> torch.Tensor:
    """Rewards of (prompt, response) texts in input order, batched by similar length: at most
    `batch_size` sequences and (when given) `max_tokens` tokens per forward pass
    (`forward.forward_batches`; a longer sequence goes alone).

    Sequences are sorted by length (stable) before batching, so padding stays small; each
    reward depends only on its own tokens and the batch composition, which is a function of the
    input alone (deterministic). Packed (`reward_batch`) where the architecture takes it.
    """
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    seqs = encode(tokenizer, prompts, responses, max_length)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    device = next(model.parameters()).device
    packed = packing and packs(model)
    out = torch.empty(len(seqs), dtype=torch.float32)
    for batch in forward_batches([len(seqs[i]) for i in order], batch_size, max_tokens):
        idx = [order[j] for j in batch]
        r = sequence_rewards(model, **reward_batch([seqs[i] for i in idx], pad_id, packed, device))
        out[torch.tensor(idx)] = r.float().cpu()
    return out
