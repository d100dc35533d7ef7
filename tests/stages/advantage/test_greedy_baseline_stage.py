"""The advantage stage on scores holding greedy baseline rows (rollout greedy_baseline: true)."""

from __future__ import annotations

import pytest

from rlpipe.schemas import ADVANTAGES, read_table_artifact
from rlpipe.schemas.rollouts import GREEDY_SAMPLE_INDEX
from rlpipe.stages.advantage.config import AdvantageConfig
from rlpipe.stages.advantage.run import run

G = GREEDY_SAMPLE_INDEX
# (group_id, sample_index, response length, reward): each group's greedy row first, as the rollout
# writes it; two shards (groups 4 and 7, then group 2).
ROWS = [
    (4, G, 2, 0.5), (4, 0, 3, 1.0), (4, 1, 1, 0.0), (4, 2, 2, 0.5),
    (7, G, 1, 1.0), (7, 0, 2, 1.0), (7, 1, 2, 0.0),
    (2, G, 3, 0.0), (2, 0, 1, 0.0), (2, 1, 4, 0.0),
]


def _write(tmp_path, artifacts, rows=ROWS, name="scores"):
    artifacts.write(tmp_path / name, artifacts.SCORES_, [artifacts.score(g, s, n, r) for g, s, n, r in rows],
                    rows_per_shard=7)
    return tmp_path / name


def test_remax_subtracts_the_greedy_reward_and_writes_no_greedy_row(tmp_path, artifacts):
    scores = _write(tmp_path, artifacts)
    manifest = run(AdvantageConfig(scores=scores, output=tmp_path / "adv", estimator="remax"))
    table = read_table_artifact(tmp_path / "adv", ADVANTAGES).to_pylist()
    # Samples only, in the scores' order, one shard per scores shard.
    assert [(r["group_id"], r["sample_index"]) for r in table] == [(g, s) for g, s, _, _ in ROWS if s != G]
    assert [f.rows for f in manifest.files] == [5, 2]
    # A_i = r_i - r_greedy: group 4 (greedy 0.5): 0.5, -0.5, 0; group 7 (greedy 1): 0, -1;
    # group 2 (greedy 0): 0, 0 (no signal).
    assert [r["advantage"] for r in table] == pytest.approx([0.5, -0.5, 0.0, 0.0, -1.0, 0.0, 0.0])
    lengths = [n for _, s, n, _ in ROWS if s != G]
    assert [len(r["token_advantages"]) for r in table] == lengths
    assert manifest.extra["rows"] == 7 and manifest.extra["greedy_rows"] == 3
    assert manifest.extra["baseline_reward_mean"] == pytest.approx((3 * 0.5 + 2 * 1.0 + 2 * 0.0) / 7)
    assert manifest.extra["zero_variance_groups"] == 1  # group 2: every sample scored the greedy reward
    assert manifest.extra["reward_mean"] == pytest.approx(2.5 / 7)  # the samples' rewards only


def test_other_estimators_ignore_the_greedy_rows(tmp_path, artifacts):
    # grpo on scores with greedy rows == grpo on the same scores without them.
    with_greedy = _write(tmp_path, artifacts)
    without = _write(tmp_path, artifacts, [r for r in ROWS if r[1] != G], name="plain")
    run(AdvantageConfig(scores=with_greedy, output=tmp_path / "a", estimator="grpo"))
    run(AdvantageConfig(scores=without, output=tmp_path / "b", estimator="grpo"))
    rows = read_table_artifact(tmp_path / "a").to_pylist()
    assert rows == read_table_artifact(tmp_path / "b").to_pylist()  # (shard cuts differ: not the hash)
    assert all(r["sample_index"] != G for r in rows) and any(r["advantage"] != 0 for r in rows)


def test_remax_errors_name_the_artifact(tmp_path, artifacts):
    without = _write(tmp_path, artifacts, [r for r in ROWS if r[1] != G], name="plain")
    with pytest.raises(ValueError, match=r"estimator 'remax': .*plain holds no greedy baseline rows \(sample_index -1\): "
                                         r"sample the rollouts with `greedy_baseline: true`"):
        run(AdvantageConfig(scores=without, output=tmp_path / "a", estimator="remax"))
    missing = _write(tmp_path, artifacts, [r for r in ROWS if (r[0], r[1]) != (7, G)], name="missing")
    with pytest.raises(ValueError, match=r"missing: group \{'iteration': 0, 'group_id': 7\} has 0 greedy baseline rows"):
        run(AdvantageConfig(scores=missing, output=tmp_path / "b", estimator="remax"))
