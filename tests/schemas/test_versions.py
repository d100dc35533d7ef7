"""Schema versions are a contract: a shard written under an earlier version of its schema is read
with the nullable columns added since as null (prompts v1 had no `messages`); one that lacks a
required column, or comes from a newer rlpipe, is refused naming both versions and what to do."""

from __future__ import annotations

from dataclasses import replace

import polars as pl
import pyarrow as pa
import pytest

from rlpipe.schemas import (
    PROMPTS,
    read_table_artifact,
    scan_artifact,
    validate_artifact,
    write_table_artifact,
)
from rlpipe.schemas.columns import ArtifactSchema
from rlpipe.schemas.errors import SchemaVersionError

ROWS = {"prompt_id": ["a", "b"], "prompt": ["1+1=", "2+2="], "answer": ["2", "4"], "metadata": [None, '{"k": 1}']}


def _version(schema: ArtifactSchema, version: int, drop: tuple[str, ...]) -> ArtifactSchema:
    """The schema as an earlier (or later) rlpipe declared it."""
    return replace(schema, version=version, columns=tuple(c for c in schema.columns if c.name not in drop))


def test_a_prompts_artifact_of_v1_reads_with_messages_as_null(tmp_path):
    v1 = _version(PROMPTS, 1, ("messages",))
    assert [c.name for c in PROMPTS.added_after(1)] == ["messages"]
    write_table_artifact(tmp_path / "old", v1, ROWS, stage="import_data")
    table = read_table_artifact(tmp_path / "old", PROMPTS)
    assert table.column_names == PROMPTS.column_names and table.schema.field("messages").type == PROMPTS.column("messages").type
    assert table.column("messages").to_pylist() == [None, None]
    assert table.column("prompt").to_pylist() == ["1+1=", "2+2="]
    frame = scan_artifact(tmp_path / "old", PROMPTS).collect()
    assert frame.columns == PROMPTS.column_names and frame["messages"].null_count() == 2
    assert frame.schema["messages"] == pl.from_arrow(PROMPTS.arrow().empty_table()).schema["messages"]
    assert validate_artifact(tmp_path / "old") == []


def test_a_required_column_missing_in_an_old_version_or_a_newer_version_is_refused(tmp_path):
    without_answer = _version(PROMPTS, 1, ("messages", "prompt"))  # as if v1 had had no required 'prompt'
    write_table_artifact(tmp_path / "old", without_answer, {k: v for k, v in ROWS.items() if k != "prompt"},
                         stage="import_data")
    with pytest.raises(SchemaVersionError) as e:
        read_table_artifact(tmp_path / "old", PROMPTS)
    message = str(e.value)
    assert "written under schema 'prompts' v1, which this rlpipe (v2) cannot read" in message
    assert "missing column 'prompt'" in message and "--force" in message and "rlpipe data import" in message
    assert "part-00000.parquet" in message

    # a newer version with the same columns reads as it is; one that differs is refused
    write_table_artifact(tmp_path / "new", replace(PROMPTS, version=3), {**ROWS, "messages": [None, None]},
                         stage="import_data")
    assert read_table_artifact(tmp_path / "new", PROMPTS).num_rows == 2

    v3 = replace(PROMPTS, version=3, columns=(*PROMPTS.columns[:-1],
                                               replace(PROMPTS.columns[-1], type=pa.string())))
    write_table_artifact(tmp_path / "newer", v3, {**ROWS, "messages": [None, "x"]}, stage="import_data")
    with pytest.raises(SchemaVersionError, match="written by a newer rlpipe \\(schema 'prompts' v3; this one reads up to v2\\): upgrade rlpipe"):
        read_table_artifact(tmp_path / "newer", PROMPTS)


def test_rollouts_of_v1_and_v2_read_as_single_turn(tmp_path):
    """Rollouts written before episodes (v1: no metadata; v2: no episode columns) read with those
    columns null: every token sampled, which is how every stage treats a null response_mask."""
    from rlpipe.schemas import ROLLOUTS
    from rlpipe.schemas.examples import example_table

    episode_columns = ["response_mask", "num_turns", "turns", "environment_reward"]
    assert [c.name for c in ROLLOUTS.added_after(2)] == episode_columns
    for version, drop in ((1, ("metadata", *episode_columns)), (2, tuple(episode_columns))):
        old = _version(ROLLOUTS, version, drop)
        rows = example_table(ROLLOUTS, 6).drop_columns(list(drop))
        write_table_artifact(tmp_path / f"v{version}", old, rows, stage="rollout")
        table = read_table_artifact(tmp_path / f"v{version}", ROLLOUTS)
        assert table.column_names == ROLLOUTS.column_names
        assert all(table.column(c).null_count == 6 for c in drop)
        assert table.column("response_token_ids").to_pylist() == rows.column("response_token_ids").to_pylist()
