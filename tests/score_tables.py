"""Rollouts tables written directly (no rollout stage), for the score tests: a helper module
with a name of its own (`from conftest import ...` would find whichever conftest came first)."""

from __future__ import annotations

from rlpipe.schemas import ROLLOUTS, write_table_artifact

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 8}


def rollouts_table(prompts, responses, answers, lengths=None, group_size=2, finish_reasons=None, metadata=None):
    """A rollouts table: row i is sample i % group_size of group i // group_size."""
    n = len(responses)
    lengths = lengths or [len(r.split()) + 1 for r in responses]
    return {
        "run": ["test"] * n,
        "iteration": [0] * n,
        "policy_version": [0] * n,
        "prompt_id": [f"p{i // group_size}" for i in range(n)],
        "group_id": [i // group_size for i in range(n)],
        "sample_index": [i % group_size for i in range(n)],
        "prompt": list(prompts),
        "prompt_token_ids": [[1, 5, 6]] * n,
        "answer": list(answers),
        "response": list(responses),
        "response_token_ids": [[7] * k for k in lengths],
        "response_logprobs": [[-0.5] * k for k in lengths],
        "finish_reason": finish_reasons or ["stop"] * n,
        "sampling": [SAMPLING] * n,
        "engine": ["transformers"] * n,
        "seed": [0] * n,
        "metadata": list(metadata) if metadata is not None else [None] * n,
    }


def write_rollouts(path, table, rows_per_shard=None):
    return write_table_artifact(path, ROLLOUTS, table, stage="test", shard_by="group_id",
                                rows_per_shard=rows_per_shard)
