"""A reference greedy decoder for tests: plain `model.generate` plus an exact-answer check.

Independent of the rollout and score stages on purpose, so tests can check the evaluate stage
(built on those stages) and SFT accuracy against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def answer_match(response: str, answer: str | None) -> float:
    """1.0 if the response equals the reference answer after stripping whitespace, else 0.0."""
    if answer is None:
        return 0.0
    return float(response.strip() == answer.strip())


@dataclass(frozen=True)
class Generation:
    response: str
    token_ids: list[int]
    finish_reason: str
    """'stop' if EOS was generated, 'length' otherwise."""


@torch.no_grad()
def greedy_generate(model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 6,
                    batch_size: int = 256) -> list[Generation]:
    """Greedy continuation of each prompt (left-padded batches, KV cache), in input order."""
    eos = tokenizer.eos_token_id
    out: list[Generation] = []
    was_training = model.training
    model.eval()
    for i in range(0, len(prompts), batch_size):
        enc = tokenizer(list(prompts[i : i + batch_size]), return_tensors="pt", padding=True,
                        padding_side="left")
        seqs = model.generate(
            **enc, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
        )
        for row in seqs[:, enc.input_ids.shape[1]:].tolist():
            ids = row[: row.index(eos) + 1] if eos in row else row
            text = tokenizer.decode(ids, skip_special_tokens=True)
            out.append(Generation(text, ids, "stop" if eos in ids else "length"))
    model.train(was_training)
    return out


def greedy_accuracy(model, tokenizer, prompts: Sequence[str], answers: Sequence[str | None],
                    max_new_tokens: int = 6, batch_size: int = 256) -> float:
    """Fraction of prompts whose greedy response matches the answer exactly."""
    gens = greedy_generate(model, tokenizer, prompts, max_new_tokens, batch_size)
    return sum(answer_match(g.response, a) for g, a in zip(gens, answers, strict=True)) / max(len(prompts), 1)
