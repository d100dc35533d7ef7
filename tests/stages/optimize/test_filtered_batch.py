"""optimize on a filtered batch (dynamic sampling): it trains on the advantages' rows only, read
from rollouts that hold more rows, exactly as on rollouts filtered by hand."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rlpipe.schemas import (
    ADVANTAGES,
    ROLLOUTS,
    read_manifest,
    read_table_artifact,
    write_table_artifact,
)
from rlpipe.stages.optimize.data import load_batch
from rlpipe.stages.optimize.run import run

KEPT = {0, 2}  # the groups a filter kept (of 0..3)


def _subset(src, dst, schema, groups=KEPT):
    t = read_table_artifact(src, schema)
    rows = [r for r in t.to_pylist() if r["group_id"] in groups]
    write_table_artifact(dst, schema, {c: [r[c] for r in rows] for c in t.column_names}, stage="test")
    return dst


@pytest.fixture
def filtered(tmp_path, tiny_tokenizer, build):
    full = build(tmp_path / "full", tiny_tokenizer, groups=4)
    return {
        "full": full,
        "advantages": _subset(full["advantages"], tmp_path / "kept_adv", ADVANTAGES),
        "hand_rollouts": _subset(full["rollouts"], tmp_path / "hand_rollouts", ROLLOUTS),
    }


def _same_batch(a, b):
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, list) and x and isinstance(x[0], np.ndarray):
            assert len(x) == len(y) and all(np.array_equal(u, v) for u, v in zip(x, y, strict=True)), f.name
        elif isinstance(x, np.ndarray):
            assert np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


def test_the_batch_is_the_advantages_rows_read_from_the_rollouts_by_key(filtered):
    batch = load_batch(filtered["full"]["rollouts"], filtered["advantages"])
    assert len(batch) == 8 and set(batch.group_id.tolist()) == KEPT
    assert batch.keys == sorted(batch.keys)  # key order, whatever order the artifacts hold
    _same_batch(batch, load_batch(filtered["hand_rollouts"], filtered["advantages"]))


def test_optimize_on_full_rollouts_equals_optimize_on_hand_filtered_rollouts(tmp_path, filtered, tiny_policy_dir,
                                                                             make_config, read_metrics):
    knobs = dict(lr=3e-3, epochs=2, minibatch_size=4, micro_batch_size=2)
    a = make_config(tmp_path, {"rollouts": filtered["full"]["rollouts"], "advantages": filtered["advantages"]},
                    tiny_policy_dir, "a", **knobs)
    b = make_config(tmp_path, {"rollouts": filtered["hand_rollouts"], "advantages": filtered["advantages"]},
                    tiny_policy_dir, "b", **knobs)
    first, second = run(a), run(b)
    assert first.content_hash == second.content_hash  # the same weights, byte for byte
    assert read_manifest(a.metrics_output).content_hash == read_manifest(b.metrics_output).content_hash
    m = read_metrics(a.metrics_output)
    assert m[0]["steps"] == 4  # 8 kept rows / minibatch 4, 2 epochs: the dropped rows are not trained on
    # Trained on all 16 rows instead, the same knobs give other weights.
    full = make_config(tmp_path, filtered["full"], tiny_policy_dir, "full", **knobs)
    assert run(full).content_hash != first.content_hash


def test_advantages_rows_missing_from_the_rollouts_are_named(tmp_path, filtered, tiny_policy_dir, make_config):
    with pytest.raises(ValueError, match=r"hand_rollouts: 8 rows of the advantages .* are missing on "
                                         r"\('iteration', 'group_id', 'sample_index'\) \(first \[\(0, 1, 0\)"):
        run(make_config(tmp_path, {"rollouts": filtered["hand_rollouts"], "advantages": filtered["full"]["advantages"]},
                        tiny_policy_dir))
