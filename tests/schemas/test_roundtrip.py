"""Every schema survives Parquet and Polars unchanged: types (List columns), values, metadata."""

import polars as pl
import pyarrow.parquet as pq
import pytest

from rlpipe.schemas import (
    LOGPROBS,
    SCHEMAS,
    SCORES,
    TOKEN_IDS,
    read_manifest,
    read_table_artifact,
    scan_artifact,
    write_table_artifact,
)
from rlpipe.schemas.columns import SCHEMA_NAME_KEY, SCHEMA_VERSION_KEY
from rlpipe.schemas.errors import IntegrityError
from rlpipe.schemas.examples import example_table
from rlpipe.schemas.table_memory import TABLES

EXTRA = {"scores": (SCORES.families[0].column("format"), SCORES.families[0].column("correct"))}


def _polars_type(arrow_type):
    return {str(TOKEN_IDS): pl.List(pl.Int32), str(LOGPROBS): pl.List(pl.Float32)}.get(str(arrow_type))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_round_trip_parquet_and_polars(tmp_path, name):
    schema = SCHEMAS[name]
    extra = EXTRA.get(name, ())
    table = example_table(schema, 11, seed=3, extra=extra)
    manifest = write_table_artifact(tmp_path / name, schema, table, stage="test", extra_columns=extra,
                                    rows_per_shard=4, shard_by="group_id" if "group_id" in table.column_names else None)
    assert manifest.rows == 11 and manifest.schema_name == name and manifest.schema_version == schema.version
    assert len(manifest.shard_names) >= 3

    # Arrow: same schema (types, nullability, docs) and the same values, across shards.
    TABLES.reset()  # (from the files: not the tables this process wrote)
    back = read_table_artifact(tmp_path / name)
    assert back.schema.equals(table.schema, check_metadata=True)
    assert back.to_pylist() == table.to_pylist()
    meta = pq.read_schema(tmp_path / name / manifest.shard_names[0]).metadata
    assert meta[SCHEMA_NAME_KEY] == name.encode() and meta[SCHEMA_VERSION_KEY] == str(schema.version).encode()

    # Polars: List(Int32) / List(Float32) columns, equal values.
    df = scan_artifact(tmp_path / name).collect()
    for col in (*schema.columns, *extra):
        expected = _polars_type(col.type)
        if expected is not None:
            assert df.schema[col.name] == expected, col.name
    assert df.columns == table.column_names
    assert df.to_dicts() == table.to_pylist()


def test_list_columns_keep_lengths_and_values(tmp_path):
    """Alignment survives: response_logprobs has the length of response_token_ids, row by row."""
    schema = SCHEMAS["rollouts"]
    table = example_table(schema, 16, seed=1)
    write_table_artifact(tmp_path / "r", schema, table, stage="test")
    df = scan_artifact(tmp_path / "r").collect()
    lens = df.select(pl.col("response_token_ids").list.len().alias("a"),
                     pl.col("response_logprobs").list.len().alias("b"))
    assert lens["a"].to_list() == lens["b"].to_list()
    assert lens["a"].to_list() == [len(x) for x in table.column("response_token_ids").to_pylist()]
    row5 = table.slice(5, 1).to_pylist()[0]
    assert df.row(5, named=True)["response_logprobs"] == pytest.approx(row5["response_logprobs"])


def test_empty_artifact_reads_as_empty_table(tmp_path):
    schema = SCHEMAS["prompts"]
    table = example_table(schema, 0)
    m = write_table_artifact(tmp_path / "p", schema, table, stage="test")
    assert m.rows == 0 and read_manifest(tmp_path / "p").rows == 0
    back = read_table_artifact(tmp_path / "p")
    assert back.num_rows == 0 and back.column_names == schema.column_names
    assert scan_artifact(tmp_path / "p").collect().height == 0


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_a_shard_this_process_wrote_is_read_from_memory_as_from_its_file(tmp_path, name, monkeypatch):
    schema = SCHEMAS[name]
    extra = EXTRA.get(name, ())
    table = example_table(schema, 11, seed=5, extra=extra)
    path = tmp_path / name
    write_table_artifact(path, schema, table, stage="test", extra_columns=extra, rows_per_shard=4)
    some = [table.column_names[-1], table.column_names[0]]
    with monkeypatch.context() as m:  # nothing is decoded: every shard comes from memory
        m.setattr(pq, "ParquetFile", None)
        whole, part = read_table_artifact(path), read_table_artifact(path, columns=some)
    TABLES.reset()
    assert whole.schema.equals(read_table_artifact(path).schema, check_metadata=True)
    assert whole.equals(read_table_artifact(path)) and part.equals(read_table_artifact(path, columns=some))
    assert part.column_names == some


def test_a_changed_shard_is_caught_though_its_table_is_in_memory(tmp_path):
    schema = SCHEMAS["scores"]
    table = example_table(schema, 6, seed=1, extra=EXTRA["scores"])
    manifest = write_table_artifact(tmp_path / "s", schema, table, stage="test", extra_columns=EXTRA["scores"])
    shard = tmp_path / "s" / manifest.shard_names[0]
    shard.write_bytes(shard.read_bytes()[:-8] + b"\0" * 8)  # (same size, other bytes)
    with pytest.raises(IntegrityError, match=manifest.shard_names[0]):
        read_table_artifact(tmp_path / "s")
