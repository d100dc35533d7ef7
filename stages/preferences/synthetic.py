"""A synthetic preference set whose chosen and rejected responses differ by a learnable property.

Kinds (and `answer_preferences`, pairs from a prompts artifact's answers):
    arithmetic  prompt 'Q: a+b= A:'; chosen ' <a+b>', rejected ' <a wrong sum>' (off by 1..3).
                The property a reward model must learn: the answer is the correct sum.
    keyword     prompt 'Q: say something A:'; both responses are random words, the chosen one
                contains the target word. The property: the target word is present.

The `preferences` stage writes them: `rlpipe stage preferences kind=keyword pairs=256 output=OUT`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa

from rlpipe.schemas import PREFERENCES, Manifest, write_table_artifact

Kind = Literal["arithmetic", "keyword"]
WORDS = ("red", "blue", "cat", "dog", "sun", "tree", "book", "car", "fish", "bird")
TARGET = "good"


def synthetic_preferences(n_pairs: int, *, kind: Kind = "arithmetic", seed: int = 0,
                          max_operand: int = 19) -> pa.Table:
    """`n_pairs` preference rows (schema `preferences`, margin null); same seed, same table."""
    rng = np.random.default_rng(seed)
    prompts, chosen, rejected = [], [], []
    for _ in range(n_pairs):
        if kind == "arithmetic":
            a, b = (int(x) for x in rng.integers(0, max_operand + 1, size=2))
            wrong = a + b + int(rng.choice([-3, -2, -1, 1, 2, 3]))
            wrong = wrong if wrong >= 0 else a + b + 1
            prompts.append(f"Q: {a}+{b}= A:")
            chosen.append(f" {a + b}")
            rejected.append(f" {wrong}")
        elif kind == "keyword":
            k = int(rng.integers(2, 5))
            words = [str(w) for w in rng.choice(WORDS, size=k)]
            pos = int(rng.integers(0, k + 1))
            prompts.append("Q: say something A:")
            chosen.append(" " + " ".join(words[:pos] + [TARGET] + words[pos:]))
            rejected.append(" " + " ".join(str(w) for w in rng.choice(WORDS, size=k + 1)))
        else:
            raise ValueError(f"unknown synthetic preference kind {kind!r}; known: arithmetic, keyword")
    return pa.table(
        {
            "pair_id": [f"{kind}-{seed}-{i:06d}" for i in range(n_pairs)],
            "prompt": prompts,
            "chosen": chosen,
            "rejected": rejected,
            "margin": pa.nulls(n_pairs, pa.float32()),
        },
        schema=PREFERENCES.arrow(),
    )


def answer_preferences(prompts: Path | str, *, wrong: Literal["near_miss", "zero_padded"] = "near_miss",
                       seed: int = 0) -> pa.Table:
    """One pair per row of a `prompts` artifact: chosen is the reference answer, rejected a wrong
    one; pair_id is '<prompt_id>-<row>'.

    wrong: 'near_miss', the answer +- 1..3 (never negative), or 'zero_padded', the answer with
    leading zeros to at least 3 digits and at least one zero ('68' -> '068', '5' -> '005',
    '104' -> '0104'; the task's flawed SFT answers are '68' -> '068').
    """
    from rlpipe.schemas import PROMPTS, read_table_artifact
    from rlpipe.schemas.errors import DataError

    table = read_table_artifact(prompts, PROMPTS, columns=["prompt_id", "prompt", "answer"])
    rng = random.Random(seed)
    rows: dict[str, list] = {"pair_id": [], "prompt": [], "chosen": [], "rejected": [], "margin": []}
    for i, (pid, prompt, answer) in enumerate(zip(*(table.column(c).to_pylist() for c in table.column_names),
                                                  strict=True)):
        try:
            right = int(answer)
        except (TypeError, ValueError):
            raise DataError(
                f"{prompts}: row {i} (prompt_id {pid!r}) has answer {answer!r}, not an integer: the "
                "preferences stage (kind 'answers') pairs integer answers with near misses; for other "
                "data give the reward model preference pairs (preset data.preferences: a file of "
                "prompt/chosen/rejected rows, or `rlpipe data import FILE OUT --kind preferences`) or "
                "a trained one (model.reward_model)") from None
        if wrong == "zero_padded":
            rejected = str(right).zfill(max(3, len(str(right)) + 1))
        else:
            miss = right + rng.choice([-3, -2, -1, 1, 2, 3])
            rejected = str(miss if miss >= 0 else right + 1)
        rows["pair_id"].append(f"{pid}-{i}")
        rows["prompt"].append(prompt)
        rows["chosen"].append(str(right))
        rows["rejected"].append(rejected)
        rows["margin"].append(None)
    return pa.table(rows, schema=PREFERENCES.arrow())


def write_synthetic_preferences(path: Path | str, n_pairs: int, *, kind: Kind = "arithmetic",
                                seed: int = 0, rows_per_shard: int | None = None) -> Manifest:
    """Write a synthetic `preferences` artifact to `path`."""
    table = synthetic_preferences(n_pairs, kind=kind, seed=seed)
    return write_table_artifact(
        path, PREFERENCES, table, stage="preferences",
        config={"n_pairs": n_pairs, "kind": kind, "seed": seed}, rows_per_shard=rows_per_shard,
    )
