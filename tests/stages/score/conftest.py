"""Small rollouts artifacts for the score tests, written directly (no rollout stage)."""

from __future__ import annotations

import pytest
from score_tables import rollouts_table, write_rollouts


@pytest.fixture
def arith_rollouts(tmp_path):
    """24 rollouts (12 groups of 2) of 'Q: a+b= A:' in 4 shards; every third answer wrong."""
    prompts, responses, answers = [], [], []
    for i in range(24):
        a, b = i % 7, i % 5
        prompts.append(f"Q: {a}+{b}= A:")
        responses.append(f" {a + b + (1 if i % 3 == 0 else 0)}")
        answers.append(str(a + b))
    path = tmp_path / "rollouts"
    write_rollouts(path, rollouts_table(prompts, responses, answers, lengths=[1 + i % 9 for i in range(24)]),
                   rows_per_shard=6)
    return path

