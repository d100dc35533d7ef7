"""A whole run (every iteration of one artifact kind) reads as one LazyFrame / Arrow dataset."""

import polars as pl
import pytest

from rlpipe.schemas import (
    ROLLOUTS,
    SCORES,
    ArtifactNotFound,
    ArtifactWriter,
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
        write_table_artifact(run / f"iter_{k:04d}" / "rollouts", ROLLOUTS,
                             example_table(ROLLOUTS, n, iteration=k, seed=k), stage="rollout",
                             rows_per_shard=4, shard_by="group_id")
    w = ArtifactWriter(run / "iter_0003" / "rollouts", ROLLOUTS, stage="rollout")
    w.write_shard(example_table(ROLLOUTS, 8, iteration=3), index=0)  # killed before commit()
    (run / "iter_0004").mkdir()  # an iteration that has not produced rollouts yet
    return run


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
        write_table_artifact(tmp_path / f"iter_{k:04d}" / "scores", SCORES,
                             example_table(SCORES, 4, iteration=k, extra=extra), stage="score",
                             extra_columns=extra)
    df = scan_run(tmp_path, "scores").collect()
    assert df.height == 8
    assert df["reward__correct"].null_count() == 4 and df["reward__format"].null_count() == 0


def test_scan_run_without_any_artifact(run_dir):
    with pytest.raises(ArtifactNotFound, match="no complete 'scores' artifact"):
        scan_run(run_dir, "scores")
