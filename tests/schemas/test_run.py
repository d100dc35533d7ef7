"""A whole run: its iteration directories (names, order) and every iteration of one artifact kind
read as one LazyFrame / Arrow dataset."""

import polars as pl
import pytest

from rlpipe.schemas import (
    INITIAL_EVAL_DIR,
    ROLLOUTS,
    SCORES,
    ArtifactNotFound,
    ArtifactWriter,
    iteration_dir_name,
    iteration_dirs,
    iteration_index,
    run_artifacts,
    run_dataset,
    scan_run,
    write_table_artifact,
)
from rlpipe.schemas.examples import example_table

ROWS = {0: 8, 1: 12, 2: 16}


@pytest.fixture
def run_dir(tmp_path):
    """runs/r/ with rollouts in iter_0000..0002 and an unfinished one (no manifest) in iter_0003."""
    run = tmp_path / "r"
    for k, n in ROWS.items():
        write_table_artifact(run / iteration_dir_name(k) / "rollouts", ROLLOUTS,
                             example_table(ROLLOUTS, n, iteration=k, seed=k), stage="rollout",
                             rows_per_shard=4, shard_by="group_id")
    w = ArtifactWriter(run / "iter_0003" / "rollouts", ROLLOUTS, stage="rollout")
    w.write_shard(example_table(ROLLOUTS, 8, iteration=3), index=0)  # killed before commit()
    (run / "iter_0004").mkdir()  # an iteration that has not produced rollouts yet
    return run


def test_iteration_names_round_trip_and_nothing_else_parses(tmp_path):
    """The on-disk names are a contract (docs, resumed runs): pinned here literally."""
    assert [iteration_dir_name(k) for k in (0, 3, 42, 9999, 12345)] == [
        "iter_0000", "iter_0003", "iter_0042", "iter_9999", "iter_12345"]
    assert INITIAL_EVAL_DIR == "eval_0000"
    for k in (0, 7, 10_000):
        assert iteration_index(iteration_dir_name(k)) == k
    for name in ("iter_3", "iter_00003", "iter_", "iter_x", "iter_0003a", "iter_-001", "iter_٠٠٠٣",
                 "Iter_0003", "eval_0000", "iter_0003.tmp"):
        assert iteration_index(name) is None, name
    with pytest.raises(ValueError, match="iteration must be >= 0"):
        iteration_dir_name(-1)
    # iteration order is numeric: by name, iter_10000 would sort before iter_9999
    for name in ("iter_10000", "iter_9999", "iter_0002", "iter_3", "eval_0000"):
        (tmp_path / name).mkdir()
    (tmp_path / "iter_0004").write_text("a file, not an iteration")
    assert iteration_dirs(tmp_path) == [
        (2, tmp_path / "iter_0002"), (9999, tmp_path / "iter_9999"), (10000, tmp_path / "iter_10000")]
    assert iteration_dirs(tmp_path / "missing") == []


def test_scan_run_reads_all_complete_iterations(run_dir):
    assert [p.parent.name for p in run_artifacts(run_dir, "rollouts")] == ["iter_0000", "iter_0001", "iter_0002"]
    lf = scan_run(run_dir, "rollouts")
    assert isinstance(lf, pl.LazyFrame)
    counts = lf.group_by("iteration").len().sort("iteration").collect()
    assert counts.rows() == [(0, 8), (1, 12), (2, 16)]
    df = lf.select("iteration", "response_token_ids").collect()
    assert df.height == 36 and df.schema["response_token_ids"] == pl.List(pl.Int32)
    # lazy: a filter and a projection read only what they need, same answer
    assert lf.filter(pl.col("iteration") == 1).select(pl.len()).collect().item() == 12


def test_scan_run_iteration_column_and_arrow_dataset(run_dir):
    lf = scan_run(run_dir, "rollouts", iteration_column="iter_dir")
    per_dir = lf.group_by("iter_dir").agg(pl.len(), (pl.col("iteration") == pl.col("iter_dir")).all().alias("same"))
    assert per_dir.sort("iter_dir").collect().rows() == [(0, 8, True), (1, 12, True), (2, 16, True)]
    dataset = run_dataset(run_dir, "rollouts")
    assert dataset.count_rows() == 36 and len(dataset.files) == 2 + 3 + 4


def test_scan_run_with_differing_reward_components(tmp_path):
    """Iterations whose scores have other reward__* columns concatenate; missing ones are null."""
    fam = SCORES.families[0]
    for k, comps in enumerate([("format",), ("format", "correct")]):
        extra = tuple(fam.column(c) for c in comps)
        write_table_artifact(tmp_path / iteration_dir_name(k) / "scores", SCORES,
                             example_table(SCORES, 4, iteration=k, extra=extra), stage="score",
                             extra_columns=extra)
    df = scan_run(tmp_path, "scores").collect()
    assert df.height == 8
    assert df["reward__correct"].null_count() == 4 and df["reward__format"].null_count() == 0


def test_scan_run_without_any_artifact(run_dir):
    with pytest.raises(ArtifactNotFound, match="no complete 'scores' artifact"):
        scan_run(run_dir, "scores")
