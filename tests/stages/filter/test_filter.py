"""The filter stage (dynamic sampling) on hand-made scores: which groups it keeps, in which order,
what it records, user predicates, errors, and the cache."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest

from rlpipe.schemas import SCORES, ArtifactWriter, read_manifest, read_table_artifact
from rlpipe.schemas.config import Variant
from rlpipe.schemas.config_files import ConfigError, load_config, union_tags
from rlpipe.schemas.rollouts import GREEDY_SAMPLE_INDEX
from rlpipe.stages.filter.config import FilterConfig, PredicateConfig
from rlpipe.stages.filter.predicates import GROUP_PREDICATES, drops, register_predicate
from rlpipe.stages.filter.run import choose_groups, run

G = GREEDY_SAMPLE_INDEX
# group_id -> sampled rewards; written as two shards (groups 6, 2, 9, then 4, 1, 8), each group's
# rows in sample order. Passing (not all equal), in group order: 1, 2, 6, 8. Dropped: 4, 9.
GROUPS = {6: [1.0, 0.0, 1.0], 2: [0.0, 0.5, 0.0], 9: [1.0, 1.0, 1.0],
          4: [0.0, 0.0, 0.0], 1: [0.25, 0.0, 0.0], 8: [0.0, 1.0, 0.0]}
SHARDS = [[6, 2, 9], [4, 1, 8]]


def write_scores(path: Path, groups=GROUPS, shards=SHARDS, greedy: dict[int, float] | None = None) -> Path:
    """A scores artifact with a `reward__correct` component column (equal to the reward)."""
    writer = ArtifactWriter(path, SCORES, stage="test", extra_columns=[SCORES.column("reward__correct")])
    for k, ids in enumerate(shards):
        rows = [(g, s, r) for g in ids for s, r in ([(G, greedy[g])] if greedy else []) + list(enumerate(groups[g]))]
        writer.write_shard({
            "run": ["t"] * len(rows), "iteration": [0] * len(rows), "prompt_id": [f"p{g}" for g, _, _ in rows],
            "group_id": [g for g, _, _ in rows], "sample_index": [s for _, s, _ in rows],
            "response_length": [2] * len(rows), "finish_reason": ["stop"] * len(rows),
            "reward": [r for *_, r in rows], "reward__correct": [r for *_, r in rows]}, index=k)
    writer.commit()
    return path


def groups_of(path: Path) -> list[int]:
    return list(dict.fromkeys(read_table_artifact(path).column("group_id").to_pylist()))


def test_all_equal_drops_groups_and_records_them(tmp_path):
    scores = write_scores(tmp_path / "scores")
    manifest = run(FilterConfig(scores=scores, output=tmp_path / "kept"))
    # Every passing group, each shard's kept rows in the shard of the same index and in its order.
    assert groups_of(tmp_path / "kept") == [6, 2, 1, 8]
    assert [f.rows for f in manifest.files] == [6, 6] and manifest.shard_names == read_manifest(scores).shard_names
    kept = read_table_artifact(tmp_path / "kept")
    assert kept.column_names == read_table_artifact(scores).column_names  # reward__correct kept
    source = [r for r in read_table_artifact(scores).to_pylist() if r["group_id"] in (6, 2, 1, 8)]
    assert kept.to_pylist() == source
    e = manifest.extra
    assert (e["groups_in"], e["groups_passed"], e["groups_kept"], e["groups_dropped"]) == (6, 4, 4, 2)
    assert e["dropped"] == [{"iteration": 0, "group_id": 4, "prompt_id": "p4"},
                            {"iteration": 0, "group_id": 9, "prompt_id": "p9"}]
    assert e["surplus"] == e["refilled"] == []


def test_keep_groups_takes_the_first_passing_groups_in_group_order(tmp_path):
    scores = write_scores(tmp_path / "scores")
    manifest = run(FilterConfig(scores=scores, output=tmp_path / "kept", keep_groups=3))
    # passing in group order: 1, 2, 6, 8 -> keep 1, 2, 6 (listed in the scores' order: 6, 2 | 1)
    assert groups_of(tmp_path / "kept") == [6, 2, 1]
    assert [g["group_id"] for g in manifest.extra["surplus"]] == [8]
    assert manifest.extra["groups_kept"] == 3 and manifest.extra["groups_surplus"] == 1


def test_shortfall_refills_with_the_first_dropped_groups_or_stops(tmp_path):
    scores = write_scores(tmp_path / "scores")
    # 4 pass, keep 5: refilled with the first dropped group in group order (4, not 9)
    manifest = run(FilterConfig(scores=scores, output=tmp_path / "kept", keep_groups=5))
    assert sorted(groups_of(tmp_path / "kept")) == [1, 2, 4, 6, 8]
    assert [g["group_id"] for g in manifest.extra["refilled"]] == [4]
    assert [g["group_id"] for g in manifest.extra["dropped"]] == [9]
    with pytest.raises(ValueError, match=r"only 4 of 6 groups pass the filter, fewer than keep_groups = 5: raise "
                                         r"the rollout's oversample, or set shortfall: refill"):
        run(FilterConfig(scores=scores, output=tmp_path / "stop", keep_groups=5, shortfall="error"))
    # choose_groups alone: (kept, surplus, refilled)
    assert choose_groups([1, 5, 7], [2, 3], 2, "refill", "x") == ([1, 5], [7], [])
    assert choose_groups([5], [2, 3, 9], 3, "refill", "x") == ([2, 3, 5], [], [2, 3])
    assert choose_groups([5], [2], None, "error", "x") == ([5], [], [])


def test_greedy_rows_go_with_their_group_and_are_not_judged(tmp_path):
    # Group 9's samples are all 1 (dropped) though its greedy row scored 0; group 1's samples differ.
    scores = write_scores(tmp_path / "scores", groups={9: [1.0, 1.0], 1: [1.0, 0.0]}, shards=[[9, 1]],
                          greedy={9: 0.0, 1: 1.0})
    run(FilterConfig(scores=scores, output=tmp_path / "kept"))
    rows = read_table_artifact(tmp_path / "kept").to_pylist()
    assert [(r["group_id"], r["sample_index"]) for r in rows] == [(1, G), (1, 0), (1, 1)]


def test_nothing_kept_is_an_error(tmp_path):
    scores = write_scores(tmp_path / "scores", groups={3: [1.0, 1.0], 5: [0.0]}, shards=[[3, 5]])
    with pytest.raises(ValueError, match=r"scores: the predicate 'all_equal' drops all 2 groups: nothing to train on"):
        run(FilterConfig(scores=scores, output=tmp_path / "kept"))


@pytest.fixture
def user_predicates(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # user_predicates.py


def test_user_predicate_by_import_path(tmp_path, user_predicates):
    scores = write_scores(tmp_path / "scores")
    cfg = load_config(FilterConfig, None, [f"scores={scores}", f"output={tmp_path / 'kept'}",
                                           "drop.name=custom", "drop.function=user_predicates:mean_above",
                                           "drop.kwargs={threshold: 0.4}"])
    run(cfg)
    # means: 6 -> 2/3, 2 -> 1/6, 9 -> 1, 4 -> 0, 1 -> 1/12, 8 -> 1/3: drop 6 and 9
    assert groups_of(tmp_path / "kept") == [2, 4, 1, 8]
    bad = cfg.model_copy(update={"drop": cfg.drop.model_copy(update={"function": "user_predicates:not_a_bool",
                                                                       "kwargs": {}})})
    with pytest.raises(ValueError, match="drop.function 'user_predicates:not_a_bool' returned int; expected a bool"):
        run(bad.model_copy(update={"output": tmp_path / "bad"}))


def test_rerun_is_a_cache_hit_and_forced_rerun_gives_the_same_hash(tmp_path):
    scores = write_scores(tmp_path / "scores")
    cfg = FilterConfig(scores=scores, output=tmp_path / "kept", keep_groups=3)
    first = run(cfg)
    assert run(cfg).created_at == first.created_at
    again = run(cfg, force=True)
    assert again.content_hash == first.content_hash and again.extra == first.extra
    other = run(cfg.model_copy(update={"keep_groups": 2}))
    assert other.cache_key != first.cache_key and other.content_hash != first.content_hash


class _Unregistered(Variant):
    name: Literal["unregistered"] = "unregistered"
    """Name."""


def test_predicate_registry_and_config_union_name_the_same_predicates():
    tags = union_tags(PredicateConfig)
    assert set(tags) == set(GROUP_PREDICATES) == {"all_equal", "custom"}
    assert all(GROUP_PREDICATES[name][0] is cls for name, cls in tags.items())
    with pytest.raises(ValueError, match="already registered"):
        register_predicate(tags["all_equal"])(lambda rewards: True)
    with pytest.raises(ValueError, match="unknown group predicate 'unregistered'"):
        drops(_Unregistered(), [1.0])
    assert drops(tags["all_equal"](), [0.1 + 0.2, 0.3]) is False  # exact equality: 0.30000000000000004 != 0.3
    assert drops(tags["all_equal"](), [0.5]) is True  # one sample: no signal
    with pytest.raises(ConfigError, match="keep_groups"):
        load_config(FilterConfig, None, ["scores=s", "output=o", "keep_groups=0"])
