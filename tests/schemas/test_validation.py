"""Reading validates every shard: errors name the file and the column; validate_artifact finds
modified and stray shards."""

import json
import shutil
import time

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlpipe.schemas import (
    ROLLOUTS,
    SCORES,
    ArtifactError,
    ArtifactNotFound,
    ArtifactWriter,
    SchemaMismatch,
    iter_shards,
    read_shard,
    read_table_artifact,
    scan_artifact,
    validate_artifact,
    write_table_artifact,
)
from rlpipe.schemas.errors import IntegrityError
from rlpipe.schemas.examples import example_table
from rlpipe.schemas.hashing import digest_file
from rlpipe.schemas.manifest import FileInfo, content_hash
from rlpipe.schemas.reading import read_manifest
from rlpipe.schemas.verify import known_hash
from rlpipe.schemas.writer import write_manifest


@pytest.fixture
def rollouts(tmp_path):
    """A valid 2-shard rollouts artifact."""
    path = tmp_path / "rollouts"
    write_table_artifact(path, ROLLOUTS, example_table(ROLLOUTS, 8), stage="test",
                         rows_per_shard=4, shard_by="group_id")
    assert validate_artifact(path) == []
    return path


def _replace_shard(path, table):
    """Overwrite shard 1 and its manifest entry (what a buggy or foreign writer would do): the
    hashes agree, so what stops the read is the schema check."""
    pq.write_table(table, path / "part-00001.parquet")
    return _rehash(path / "part-00001.parquet")


def _rehash(shard):
    """Make the manifest agree with the shard's new bytes (hash, size, content hash)."""
    manifest = read_manifest(shard.parent)
    files = [f.model_copy(update={"bytes": shard.stat().st_size, "xxh3_128": digest_file(shard)})
             if f.name == shard.name else f for f in manifest.files]
    write_manifest(shard.parent, manifest.model_copy(update={"files": files, "content_hash": content_hash(files)}))
    return shard


def test_missing_column_names_file_and_column(rollouts):
    shard = _replace_shard(rollouts, example_table(ROLLOUTS, 4).drop_columns(["response_logprobs"]))
    with pytest.raises(SchemaMismatch) as e:
        read_table_artifact(rollouts)
    assert e.value.path == shard
    assert str(shard) in str(e.value) and "missing column 'response_logprobs'" in str(e.value)
    assert e.value.problems == ["missing column 'response_logprobs' (list<item: float>)"]
    # scan_artifact checks the same before Polars reads anything
    with pytest.raises(SchemaMismatch, match="response_logprobs"):
        scan_artifact(rollouts)


def test_wrong_type_names_file_and_column(rollouts):
    table = example_table(ROLLOUTS, 4)
    i = table.column_names.index("response_token_ids")
    table = table.set_column(i, pa.field("response_token_ids", pa.list_(pa.int64())),
                             table.column(i).cast(pa.list_(pa.int64())))
    shard = _replace_shard(rollouts, table)
    with pytest.raises(SchemaMismatch) as e:
        read_table_artifact(rollouts)
    assert str(shard) in str(e.value)
    assert e.value.problems == [
        "column 'response_token_ids': type list<element: int64>, expected list<item: int32>"]


def test_unexpected_column_and_nulls_are_reported(rollouts):
    table = example_table(ROLLOUTS, 4).append_column("junk", pa.array([1, 2, 3, 4]))
    _replace_shard(rollouts, table)
    with pytest.raises(SchemaMismatch, match=r"unexpected column 'junk' \(int64\)"):
        read_table_artifact(rollouts)
    # a null in a non-nullable column: the file's schema is fine, the values are not
    table = example_table(ROLLOUTS, 4)
    i = table.column_names.index("response")
    nullable = pa.schema([f.with_nullable(True) for f in table.schema])
    bad = table.cast(nullable).set_column(i, nullable.field(i), pa.array(["a", None, "c", "d"]))
    shard = _replace_shard(rollouts, bad)
    with pytest.raises(SchemaMismatch) as e:
        read_table_artifact(rollouts)
    assert str(shard) in str(e.value)
    assert "column 'response' is not nullable but has 1 null(s), first at row 1" in str(e.value)


def test_foreign_csv_file(rollouts):
    shard = rollouts / "part-00001.parquet"
    shard.write_text("run,iteration\nx,1\n")
    _rehash(shard)
    with pytest.raises(SchemaMismatch) as e:
        read_table_artifact(rollouts)
    assert e.value.path == shard and str(shard) in str(e.value)
    assert "not a readable Parquet file" in str(e.value) and "'rollouts'" in str(e.value)
    with pytest.raises(SchemaMismatch, match="not a readable Parquet file"):
        scan_artifact(rollouts)
    problems = validate_artifact(rollouts)
    assert any(str(shard) in p and "not a readable Parquet file" in p for p in problems)


def test_shard_of_another_schema(rollouts, tmp_path):
    write_table_artifact(tmp_path / "scores", SCORES, example_table(SCORES, 4), stage="test")
    shard = rollouts / "part-00001.parquet"
    shutil.copy(tmp_path / "scores" / "part-00000.parquet", shard)
    _rehash(shard)
    with pytest.raises(SchemaMismatch) as e:
        read_table_artifact(rollouts)
    msg = str(e.value)
    assert str(shard) in msg
    assert "file declares schema 'scores', expected 'rollouts'" in msg
    assert "missing column 'response_token_ids' (list<item: int32>)" in msg
    assert "unexpected column 'reward' (float)" in msg


def test_reading_with_the_wrong_expected_schema(rollouts):
    with pytest.raises(SchemaMismatch, match="artifact holds 'rollouts' rows, expected 'scores'"):
        read_table_artifact(rollouts, SCORES)
    with pytest.raises(ArtifactError, match="unknown schema 'nope'"):
        read_table_artifact(rollouts, "nope")


def test_validate_detects_modified_shard(rollouts):
    shard = rollouts / "part-00000.parquet"
    other = example_table(ROLLOUTS, 4, seed=99)  # valid rows, other content
    pq.write_table(other, shard)
    problems = validate_artifact(rollouts)
    assert problems == [f"{shard}: content differs from the manifest's xxh3_128 (modified after writing)"]


def test_validate_detects_stray_and_missing_shards(rollouts):
    shutil.copy(rollouts / "part-00001.parquet", rollouts / "part-00007.parquet")
    assert validate_artifact(rollouts) == [
        f"{rollouts}: shards not listed in the manifest: ['part-00007.parquet']"]
    (rollouts / "part-00007.parquet").unlink()
    (rollouts / "part-00000.parquet").unlink()
    assert validate_artifact(rollouts) == [f"{rollouts / 'part-00000.parquet'}: listed in the manifest but missing"]


def test_validate_reports_row_count_mismatch(rollouts):
    pq.write_table(example_table(ROLLOUTS, 3), rollouts / "part-00000.parquet")
    problems = validate_artifact(rollouts)
    assert f"{rollouts / 'part-00000.parquet'}: 3 rows, manifest says 4" in problems


def test_missing_manifest_means_no_artifact(rollouts, tmp_path):
    (rollouts / "_manifest.json").unlink()
    with pytest.raises(ArtifactNotFound, match="no _manifest.json"):
        read_table_artifact(rollouts)
    with pytest.raises(ArtifactNotFound, match="does not exist"):
        list(iter_shards(tmp_path / "nowhere"))
    assert validate_artifact(rollouts) == [
        f"artifact {rollouts} has no _manifest.json (incomplete: its stage did not finish)"]


def test_writer_rejects_bad_tables(tmp_path):
    w = ArtifactWriter(tmp_path / "r", ROLLOUTS, stage="test")
    table = example_table(ROLLOUTS, 4)
    with pytest.raises(ArtifactError, match=r"missing columns \['seed'\], unexpected columns \['junk'\]"):
        w.write_shard(table.drop_columns(["seed"]).append_column("junk", pa.array([1, 2, 3, 4])), 0)
    with pytest.raises(ArtifactError, match="column 'response' cannot be cast from list<item: int64>"):
        w.write_shard(table.set_column(table.column_names.index("response"), "response",
                                       pa.array([[1], [2], [3], [4]])), 0)
    bad = table.to_pydict()
    bad["response"][2] = None
    with pytest.raises(SchemaMismatch, match="column 'response' is not nullable but has 1 null"):
        w.write_shard(bad, 0)
    assert not (tmp_path / "r").exists() and not list(w.staging.iterdir())  # nothing was written


# -- verified reads: every read checks what the manifest promises -----------------------------
def test_a_shard_rewritten_after_its_manifest_stops_every_reader(rollouts):
    """Valid rows of the right schema, other content, manifest untouched: the sha256 catches it
    (the schema check alone would have read the tampered rows)."""
    shard = rollouts / "part-00001.parquet"
    before = read_table_artifact(rollouts)  # verified once: the process remembers the hash
    pq.write_table(example_table(ROLLOUTS, 4, seed=99), shard)
    for read in (read_table_artifact, scan_artifact, lambda p: list(iter_shards(p))):
        with pytest.raises(IntegrityError, match=f"{shard}: content differs from {rollouts / '_manifest.json'}"):
            read(rollouts)
    with pytest.raises(IntegrityError, match=str(shard)):
        read_shard(shard, ROLLOUTS)  # a lone shard is checked against the manifest beside it
    assert before.num_rows == 8


def test_a_lazy_scan_verifies_what_it_reads_when_collected(rollouts):
    """scan_artifact checks the shards when it is called and reads them, verified, when the
    frame is collected: a query returns the artifact's rows (projection, filter and limit applied
    as on the table), and a shard replaced in between fails the collect instead of being read."""
    lf = scan_artifact(rollouts)
    table = pl.from_arrow(read_table_artifact(rollouts))
    for query in (lambda f: f.filter(pl.col("sample_index") >= 1).select("group_id", "sample_index").head(5),
                  lambda f: f.head(6).filter(pl.col("group_id") == 1).select("response"),
                  lambda f: f.select(pl.len(), pl.col("response_token_ids").list.len().sum())):
        assert query(lf).collect().rows() == query(table).rows()
    shard = rollouts / "part-00001.parquet"
    pq.write_table(example_table(ROLLOUTS, 4, seed=99), shard)  # valid rows, other content
    with pytest.raises(IntegrityError, match=f"{shard}: content differs from"):
        lf.collect()
    assert lf.head(4).collect().rows() == table.head(4).rows()  # shard 0 alone: still the verified rows


def test_the_hash_memo_never_hides_a_change(rollouts):
    """A file verified once is not hashed again while its stat is unchanged, and only once its
    last change is older than the racy window; a same-size bit flip changes ctime and is caught."""
    shard = rollouts / "part-00000.parquet"
    read_table_artifact(rollouts)
    assert known_hash(shard) is None  # written just now: racily clean, not remembered
    time.sleep(1.1)  # past the racy window (1 s)
    read_table_artifact(rollouts)
    assert known_hash(shard) == f"xxh3_128:{digest_file(shard)}"  # remembered: the next read skips the hash
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    with open(shard, "r+b") as f:  # same inode, same size
        f.write(bytes(data))
    assert known_hash(shard) is None
    with pytest.raises(IntegrityError, match=str(shard)):
        read_table_artifact(rollouts)


def test_an_edited_manifest_and_a_stray_listed_row_count_are_refused(rollouts):
    mpath = rollouts / "_manifest.json"
    m = json.loads(mpath.read_text())
    m["files"][0]["xxh3_128"] = "0" * 32  # content_hash no longer matches the file list
    mpath.write_text(json.dumps(m))
    with pytest.raises(IntegrityError, match=f"{mpath}: content_hash does not match its file list"):
        read_table_artifact(rollouts)
    # a consistent manifest whose row count lies
    m = json.loads(mpath.read_text())
    m["files"][0]["xxh3_128"] = digest_file(rollouts / "part-00000.parquet")
    m["files"][0]["rows"] = 5
    files = [FileInfo(**f) for f in m["files"]]
    m["content_hash"] = content_hash(files)
    mpath.write_text(json.dumps(m))
    with pytest.raises(IntegrityError, match=r"part-00000.parquet: 4 rows, its manifest says 5"):
        read_table_artifact(rollouts)


def test_a_shard_dropped_into_a_complete_artifact_is_refused(rollouts):
    stray = rollouts / "part-00009.parquet"
    shutil.copy(rollouts / "part-00000.parquet", stray)
    with pytest.raises(IntegrityError, match=f"{stray}: not listed in"):
        read_shard(stray, ROLLOUTS)
