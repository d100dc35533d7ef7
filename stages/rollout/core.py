"""Pure pieces of the rollout stage: seeds, prompt/shard/worker slicing, sampling math, stop strings.

Notation: V vocabulary size, B rows (sequences) sampled in one step, G samples per group.
Nothing here reads a file or a config object.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch


# ---------------------------------------------------------------------------------------------
# Seeds and slicing
# ---------------------------------------------------------------------------------------------
def group_seed(seed: int, iteration: int, group_id: int) -> int:
    """Seed of one group, a function of (seed, iteration, group_id) only.

    A group's samples then do not depend on batch composition, shard size or worker count.
    31 bits, so an engine may add the sample index (vLLM seeds child i of an n>1 request with
    seed + i) and stay within a signed 32-bit int.
    """
    digest = hashlib.sha256(f"rlpipe.rollout:{seed}:{iteration}:{group_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x3FFFFFFF


def select_prompts(available: int, num_prompts: int | None, offset: int) -> list[int]:
    """Row indices of the prompts to sample: `num_prompts` rows from `offset`, wrapping around.

    Group g of the iteration is prompt row `(offset + g) % available`.
    """
    if available <= 0:
        raise ValueError("no prompts to sample from")
    n = available if num_prompts is None else num_prompts
    return [(offset + g) % available for g in range(n)]


def shard_ranges(num_groups: int, groups_per_shard: int) -> list[range]:
    """Shard k holds groups [k*S, (k+1)*S) (the last one may be shorter)."""
    return [range(s, min(s + groups_per_shard, num_groups)) for s in range(0, num_groups, groups_per_shard)]


def worker_shards(num_shards: int, worker_index: int | None, worker_count: int) -> list[int]:
    """Shards a worker writes: k with k % N == i (all shards when worker_index is None)."""
    if worker_index is None:
        return list(range(num_shards))
    return [k for k in range(num_shards) if k % worker_count == worker_index]


# ---------------------------------------------------------------------------------------------
# Sampling math
# ---------------------------------------------------------------------------------------------
def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution tokens are drawn from: temperature, then top-k, then top-p (nucleus).

    Args:
        logits: raw next-token logits.
        temperature: > 0 (greedy decoding is handled by the caller).
        top_k: keep the k largest logits (0 = all).
        top_p: keep the smallest prefix of tokens, by descending probability, whose mass reaches
            top_p (the most likely token is always kept; 1.0 = all).

    Shape:
        logits (B, V) -> probs (B, V), rows sum to 1, zeros outside the kept set.
    """
    # p_i = softmax(z / T)_i restricted to the kept set K, renormalised.
    z = logits.float() / temperature
    if 0 < top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of strictly likelier tokens
        drop_sorted = mass_before >= top_p  # token i is kept while the mass before it is < top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row by inverting the CDF: the first i with cdf_i > u * cdf_V.

    Each row uses its own uniform, so a row's draw never depends on the other rows in the batch.
    Tokens with zero probability are never drawn (their cdf equals the previous one).

    Shape:
        probs (B, V), uniforms (B,) in [0, 1) -> token ids (B,) int64.
    """
    cdf = torch.cumsum(probs.double(), dim=-1)
    target = (uniforms.double() * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log pi(token) under the raw logits (temperature 1, no filtering): the behaviour log-prob.

    Shape:
        logits (B, V), tokens (B,) -> (B,) float32.
    """
    # log pi(a) = z_a - logsumexp(z)
    z = logits.float()
    return z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


# ---------------------------------------------------------------------------------------------
# Stop strings
# ---------------------------------------------------------------------------------------------
def find_stop(text: str, stops: tuple[str, ...] | list[str]) -> int | None:
    """Index where the earliest stop string starts in `text`, or None if none occurs."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


# ---------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------
def chat_turns(prompt: str, messages: list[dict[str, str]] | None, system_prompt: str | None) -> list[dict[str, str]]:
    """The turns a chat template renders: the prompt's messages, or the plain prompt as one user
    turn, after a system turn `system_prompt` unless the messages start with a system turn."""
    turns = [{"role": m["role"], "content": m["content"]} for m in messages] if messages else [
        {"role": "user", "content": prompt}]
    if system_prompt is not None and turns[0]["role"] != "system":
        turns.insert(0, {"role": "system", "content": system_prompt})
    return turns


def templated_token_ids(tokenizer: Any, turns: list[dict[str, str]]) -> list[int]:
    """Token ids of `turns` under the tokenizer's chat template, ending with the generation prompt
    (the assistant turn's opening), exactly as `tokenizer.apply_chat_template(turns,
    add_generation_prompt=True)` gives them (a list in transformers 4, a BatchEncoding in 5)."""
    out = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)
