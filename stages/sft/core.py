"""Pure pieces of supervised fine-tuning: example encoding, batching, the masked loss, the schedule.

Notation: a batch of B sequences right-padded to length L; `labels[b, i]` is the token to predict
at position i (the input token i+1) or -100 where position i carries no loss. The loss is the
token-mean cross-entropy over the labelled tokens of the *global* batch (all ranks):

    L = (1 / N_global) * sum_{b,i: labels[b,i] != -100} -log p(labels[b,i] | tokens[b, :i+1])

Each rank returns its own sum divided by N_global times the world size, because DeepSpeed averages
gradients over ranks; so 1 rank x B sequences and 2 ranks x B/2 sequences give the same update.

Tool-use answers hold the environment's replies (`<tool_response>` blocks, `answer_segments`):
those tokens are inputs to the later positions but never targets, as in an RL episode's mask.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Literal

import numpy as np
import torch

IGNORE = -100


@dataclass(frozen=True)
class Example:
    """One training sequence: token ids and, per token, whether it is a prediction target."""

    input_ids: list[int]
    target: list[bool]
    """target[i]: token i carries loss (is predicted from tokens [0, i))."""

    @property
    def num_targets(self) -> int:
        return sum(self.target)


def encode_example(prompt_ids: Sequence[int], answer_ids: Sequence[int] | None, eos_id: int,
                   max_length: int, loss_on: Literal["answer", "all"],
                   answer_trained: Sequence[bool] | None = None) -> Example:
    """Build one example from tokenised prompt (BOS included) and answer (None: plain text).

    With an answer the sequence is prompt + answer + EOS; targets are the answer and EOS tokens
    ('answer') or every token but the first ('all'). Plain text trains on every token but the
    first. Truncated to `max_length` tokens from the right.

    answer_trained: per answer token, False where the environment wrote it (a tool's reply,
    `encode_answer`): never a target, whatever `loss_on` says. None: every answer token is the
    model's.
    """
    if answer_ids is None:
        ids = list(prompt_ids)
        target = [False] + [True] * (len(ids) - 1)
    else:
        if answer_trained is not None and len(answer_trained) != len(answer_ids):
            raise ValueError(f"answer_trained has {len(answer_trained)} flags for {len(answer_ids)} answer tokens")
        ids = list(prompt_ids) + list(answer_ids) + [eos_id]
        n_prompt = len(prompt_ids)
        first = 1 if loss_on == "all" else n_prompt
        target = [i >= first for i in range(len(ids))]
        if answer_trained is not None:
            end = n_prompt + len(answer_ids)
            target[n_prompt:end] = [t and keep for t, keep in zip(target[n_prompt:end], answer_trained, strict=True)]
    return Example(ids[:max_length], target[:max_length])


@cache
def _tool_response_pattern() -> re.Pattern[str]:
    """The environment's reply in a raw-text episode, new lines around it included (`TextTurns`),
    built from the tools' own `tool_response_text` so the two never drift apart."""
    from rlpipe.stages.rollout.environments.tools import tool_response_text

    opening, closing = tool_response_text("\0").split("\0")
    return re.compile(r"\n?" + re.escape(opening) + ".*?" + re.escape(closing) + r"\n?", re.DOTALL)


def answer_segments(answer: str, mask_tool_responses: bool) -> list[tuple[str, bool]]:
    """`answer` cut into (text, trained) pieces: the tools' replies (`<tool_response>` blocks and
    the new lines around them, inserted by the environment) untrained, the rest trained. Empty
    pieces are dropped; without `mask_tool_responses`, or without a reply, one trained piece."""
    if not mask_tool_responses:
        return [(answer, True)]
    out, start = [], 0
    for m in _tool_response_pattern().finditer(answer):
        out += [(answer[start:m.start()], True), (m.group(), False)]
        start = m.end()
    out.append((answer[start:], True))
    return [(text, trained) for text, trained in out if text] or [(answer, True)]


def encode_answer(tokenize: Callable[[str], list[int]], segments: Sequence[tuple[str, bool]]
                  ) -> tuple[list[int], list[bool]]:
    """Token ids of the answer and, per token, whether it is trained: each segment tokenised on
    its own (as an episode tokenises the environment's reply apart from the model's turns), the
    ids concatenated."""
    ids: list[int] = []
    trained: list[bool] = []
    for text, keep in segments:
        seg = list(tokenize(text))
        ids += seg
        trained += [keep] * len(seg)
    return ids, trained


def collate(examples: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad examples into (input_ids, attention_mask, labels), each (B, L).

    labels[b, i] = input_ids[b, i+1] where token i+1 is a target, else -100 (the label is already
    shifted, so the loss needs no shift).
    """
    B = len(examples)
    L = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    labels = torch.full((B, L), IGNORE, dtype=torch.long)
    for b, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[b, :n] = torch.tensor(e.input_ids, dtype=torch.long)
        attention_mask[b, :n] = 1
        labels[b, : n - 1] = _shifted_labels(e)
    return input_ids, attention_mask, labels


def _shifted_labels(e: Example) -> torch.Tensor:
    """(len - 1,): label i = token i+1 where it is a target, else IGNORE."""
    ids = torch.tensor(e.input_ids, dtype=torch.long)
    return torch.where(torch.tensor(e.target[1:], dtype=torch.bool), ids[1:], torch.full_like(ids[1:], IGNORE))


def collate_packed(examples: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The examples packed without padding (forward.PackedRows): (input_ids, position_ids, labels),
    each (R, width), R <= B; labels as `collate`'s (a row's padding and each example's last token
    are no target, so no example's loss reads another's tokens)."""
    from rlpipe.stages.common.forward import PackedRows

    rows = PackedRows([e.input_ids for e in examples], pad_id)
    labels = torch.full(rows.input_ids.shape, IGNORE, dtype=torch.long)
    for b, e in enumerate(examples):
        at = rows.start_of[b]
        labels[rows.row_of[b], at: at + len(e.input_ids) - 1] = _shifted_labels(e)
    return rows.input_ids, rows.position_ids, labels


def sft_loss(logits: torch.Tensor, labels: torch.Tensor, num_global_targets: int,
             world_size: int = 1) -> torch.Tensor:
    """Summed target cross-entropy, normalised by the global target count (see module doc).

    Shape:
        logits (B, L, V), labels (B, L) -> scalar.
    """
    # L_rank = world_size * sum_{labelled} CE / N_global; DeepSpeed's mean over ranks undoes world_size.
    ce = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    return ce * world_size / max(num_global_targets, 1)


def batch_schedule(n_examples: int, batch_size: int, num_steps: int, seed: int) -> list[np.ndarray]:
    """Example indices of each step: epoch-wise random permutations (seeded), concatenated and cut
    into `num_steps` batches of `batch_size` (the last epoch may be partial)."""
    rng = np.random.default_rng(seed)
    need = num_steps * batch_size
    order = np.concatenate([rng.permutation(n_examples) for _ in range(math.ceil(need / n_examples))])
    return [order[s * batch_size : (s + 1) * batch_size] for s in range(num_steps)]


def num_steps(n_examples: int, batch_size: int, epochs: float, max_steps: int | None) -> int:
    """Optimizer steps: max_steps if given, else ceil(epochs * n_examples / batch_size)."""
    if max_steps is not None:
        return max_steps
    return max(1, math.ceil(epochs * n_examples / batch_size))


def lr_factor(step: int, total: int, warmup: int, schedule: Literal["constant", "linear", "cosine"]) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warm-up, then decay."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * progress))
