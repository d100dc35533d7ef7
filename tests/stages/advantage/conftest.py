"""Builders of small hand-made rollouts / scores / reference artifacts (no rollout or score stage)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpipe.schemas import REFERENCE, ROLLOUTS, SCORES, write_table_artifact


def write_rows(path: Path, schema, rows: list[dict], rows_per_shard: int | None = None):
    """Write `rows` (full column dicts, in order) as an artifact, cut into shards of about
    `rows_per_shard` rows that never split a group."""
    table = {c: [r[c] if not schema.column(c).nullable else r.get(c) for r in rows] for c in schema.column_names}
    return write_table_artifact(path, schema, table, stage="test", shard_by="group_id", rows_per_shard=rows_per_shard)


def rollout_row(group_id: int, sample_index: int, prompt_ids: list[int], response_ids: list[int],
                logprobs: list[float | None], iteration: int = 0, mask: list[int] | None = None) -> dict:
    return {
        "run": "test", "iteration": iteration, "policy_version": 0, "prompt_id": f"p{group_id}",
        "group_id": group_id, "sample_index": sample_index, "prompt": "q", "prompt_token_ids": prompt_ids,
        "answer": None, "response": "a", "response_token_ids": response_ids, "response_logprobs": logprobs,
        "finish_reason": "stop", "engine": "transformers", "seed": 0, "metadata": None,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 8}, "response_mask": mask,
    }


def score_row(group_id: int, sample_index: int, length: int, reward: float, iteration: int = 0) -> dict:
    return {"run": "test", "iteration": iteration, "prompt_id": f"p{group_id}", "group_id": group_id,
            "sample_index": sample_index, "response_length": length, "finish_reason": "stop", "reward": reward}


def reference_row(group_id: int, sample_index: int, ref_logprobs, values, iteration: int = 0) -> dict:
    return {"run": "test", "iteration": iteration, "group_id": group_id, "sample_index": sample_index,
            "ref_logprobs": ref_logprobs, "values": values}



@pytest.fixture
def artifacts():
    """Namespace of the builders above."""

    class Builders:
        write = staticmethod(write_rows)
        rollout = staticmethod(rollout_row)
        score = staticmethod(score_row)
        reference = staticmethod(reference_row)
        ROLLOUTS_, SCORES_, REFERENCE_ = ROLLOUTS, SCORES, REFERENCE

    return Builders
