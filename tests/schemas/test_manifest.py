"""Manifests: what they record, content hashes, cache keys, checkpoint directories."""

import json
import re
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from rlpipe.schemas import (
    MANIFEST_NAME,
    PROMPTS,
    cache_key,
    cached_manifest,
    commit_directory,
    read_manifest,
    validate_artifact,
    write_table_artifact,
)
from rlpipe.schemas.examples import example_table
from rlpipe.schemas.staging import staging_path


def test_cache_key_equality():
    cfg = {"seed": 1, "output": "runs/a/iter_0000/rollouts", "sampling": {"temperature": 1.0}}
    key = cache_key("rollout", cfg, {"prompts": "abc", "policy": "def"})
    # same stage, config (any key order) and inputs (any order) -> same key
    assert key == cache_key("rollout", dict(reversed(list(cfg.items()))), {"policy": "def", "prompts": "abc"})
    assert re.fullmatch(r"[0-9a-f]{64}", key)  # hex SHA-256
    # anything different -> different key
    assert key != cache_key("score", cfg, {"prompts": "abc", "policy": "def"})
    assert key != cache_key("rollout", {**cfg, "seed": 2}, {"prompts": "abc", "policy": "def"})
    assert key != cache_key("rollout", {**cfg, "sampling": {"temperature": 0.5}}, {"prompts": "abc", "policy": "def"})
    assert key != cache_key("rollout", cfg, {"prompts": "abc", "policy": "xyz"})
    assert key != cache_key("rollout", cfg, {"prompts": "abc"})


def test_manifest_records_provenance_and_cache_hit(tmp_path):
    out = tmp_path / "prompts"
    key = cache_key("data", {"n": 5}, {})
    table = example_table(PROMPTS, 5)
    before = datetime.now().astimezone().replace(microsecond=0)  # created_at has whole seconds
    t0 = time.time()
    m = write_table_artifact(out, PROMPTS, table, stage="data", config={"n": 5}, cache_key=key)
    elapsed, after = time.time() - t0, datetime.now().astimezone()
    on_disk = json.loads((out / MANIFEST_NAME).read_text())
    assert on_disk["schema_name"] == "prompts" and on_disk["rows"] == 5 and on_disk["stage"] == "data"
    assert on_disk["config"] == {"n": 5} and on_disk["cache_key"] == key
    assert {"pyarrow", "pydantic", "python"} <= set(on_disk["library_versions"])
    # the default wall time is the time the call took; created_at is an aware timestamp of now
    assert 0 < on_disk["wall_time_s"] <= elapsed
    created = datetime.fromisoformat(on_disk["created_at"])
    assert created.utcoffset() == timedelta(0) and before <= created <= after
    assert read_manifest(out) == m
    assert cached_manifest(out, key) == m
    assert cached_manifest(out, cache_key("data", {"n": 6}, {})) is None
    assert cached_manifest(tmp_path / "nothing", key) is None
    # same rows -> same content hash, whatever the run; other rows -> another hash
    again = write_table_artifact(tmp_path / "again", PROMPTS, table, stage="data")
    assert again.content_hash == m.content_hash
    other = write_table_artifact(tmp_path / "other", PROMPTS, example_table(PROMPTS, 5, seed=1), stage="data")
    assert other.content_hash != m.content_hash


def test_commit_directory_hashes_every_file(tmp_path):
    ckpt = tmp_path / "policy"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    (ckpt / "sub" / "weights.bin").write_bytes(b"\0" * 10)
    (ckpt / ".model.bin.123.tmp").write_bytes(b"x")  # a leftover temporary file is not content
    m = commit_directory(ckpt, stage="optimize", config={"lr": 1e-6})
    assert m.kind == "checkpoint" and [f.name for f in m.files] == ["config.json", "sub/weights.bin"]
    assert m.shard_names == [] and validate_artifact(ckpt) == []
    (ckpt / "sub" / "weights.bin").write_bytes(b"\1" * 10)
    assert validate_artifact(ckpt) == [f"{ckpt / 'sub' / 'weights.bin'}: content differs from the manifest's xxh3_128 (modified after writing)"]


def test_workers_share_one_artifact(tmp_path):
    """Workers write disjoint shards (clean=False); one commit lists and hashes them all, and the
    content hash equals that of the same shards written by one writer."""
    from rlpipe.schemas import ROLLOUTS, ArtifactWriter, SchemaMismatch, read_table_artifact

    parts = [example_table(ROLLOUTS, 4, seed=i) for i in range(3)]
    one = ArtifactWriter(tmp_path / "one", ROLLOUTS, stage="rollout")
    for i, part in enumerate(parts):
        one.write_shard(part, index=i)
    single = one.commit()

    shared = tmp_path / "shared"
    workers = [ArtifactWriter(shared, ROLLOUTS, stage="rollout", clean=False) for i in range(3)]
    for i, w in enumerate(workers):
        w.write_shard(parts[i], index=i)
    m = workers[0].commit()  # knows shard 0 only; hashes 1 and 2 from disk
    assert m.rows == 12 and m.shard_names == single.shard_names and m.content_hash == single.content_hash
    assert read_table_artifact(shared).to_pylist() == [r for p in parts for r in p.to_pylist()]
    # a foreign file among the shards is refused at commit time, naming it
    w = ArtifactWriter(shared, ROLLOUTS, stage="rollout", clean=False)
    (w.staging / "part-00009.parquet").write_text("not parquet")
    with pytest.raises(SchemaMismatch, match="(?s)part-00009.parquet.*not a readable Parquet file"):
        w.commit()
    assert read_table_artifact(shared).num_rows == 12  # the committed artifact is untouched


def test_worker_protocol_commits_once_every_worker_is_done(tmp_path):
    """prepare_worker / finish_worker: a worker that finishes first gets an in-memory partial
    manifest (nothing written); the last one commits the same manifest one writer would."""
    from rlpipe.schemas import ROLLOUTS, ArtifactWriter, exists, shard_name

    parts = [example_table(ROLLOUTS, 4, seed=i) for i in range(4)]
    one = ArtifactWriter(tmp_path / "one", ROLLOUTS, stage="rollout")
    for i, part in enumerate(parts):
        one.write_shard(part, index=i)
    single = one.commit()

    shared, names = tmp_path / "shared", [shard_name(k) for k in range(4)]
    staging = staging_path(shared, shared=True)
    staging.mkdir()
    (staging / shard_name(7)).write_text("a shard of an older run")  # removed by prepare_worker
    writers = [ArtifactWriter(shared, ROLLOUTS, stage="rollout", cache_key="k" * 64, clean=False)
               for _ in range(2)]
    mine = {0: [0, 2], 1: [1, 3]}  # worker i writes the shards k with k % 2 == i
    results = {}
    for i in (1, 0):  # worker 1 finishes first
        w = writers[i]
        w.prepare_worker(i, 2, others=[shard_name(k) for k in mine[1 - i]])
        for k in mine[i]:
            w.write_shard(parts[k], index=k)
        results[i] = w.finish_worker(i, 2, expected=names, commit=w.commit, extra={"who": i})
        assert exists(shared) == (i == 0)
    partial = results[1]
    assert partial.extra == {"who": 1, "partial": True, "worker_index": 1, "worker_count": 2}
    assert partial.shard_names == [shard_name(1), shard_name(3)] and partial.rows == 8
    final = read_manifest(shared)
    assert final == results[0] and final.extra == {}  # commit() as the worker passed it
    assert final.shard_names == names and final.content_hash == single.content_hash
    assert sorted(p.name for p in shared.iterdir()) == sorted([*names, MANIFEST_NAME])  # markers gone
    assert not staging.exists()


def test_a_launch_counts_only_its_own_workers_markers(tmp_path):
    """A worker of an attempt that failed left its done marker. Run by hand, one at a time, its
    sibling later commits on that marker (how a group finishes across runs); a launch of the whole
    group forgets it first, so that its first worker to finish does not commit and swap the
    staging directory away while the other, started but slower, still writes into it (a CI failure
    of tests/cluster/test_resident.py: 'cannot write the shard ... No such file or directory')."""
    from rlpipe.schemas import ROLLOUTS, ArtifactWriter, exists, shard_name
    from rlpipe.schemas.writer import forget_finished_workers

    parts = [example_table(ROLLOUTS, 4, seed=i) for i in range(2)]
    names = [shard_name(0), shard_name(1)]
    single = ArtifactWriter(tmp_path / "one", ROLLOUTS, stage="rollout")
    for k, part in enumerate(parts):
        single.write_shard(part, index=k)
    expected = single.commit().content_hash

    def writer(shared: Path) -> ArtifactWriter:
        return ArtifactWriter(shared, ROLLOUTS, stage="rollout", cache_key="k" * 64, clean=False)

    def work(w: ArtifactWriter, i: int):
        w.prepare_worker(i, 2, others=[names[1 - i]])
        w.write_shard(parts[i], index=i)
        return w.finish_worker(i, 2, expected=names, commit=w.commit)

    for launched in (False, True):
        shared = tmp_path / f"launched-{launched}"
        assert work(writer(shared), 1).extra["partial"]  # the failed attempt: worker 1 was done
        if launched:
            forget_finished_workers(shared)
        late, early = writer(shared), writer(shared)  # both started; worker 0 finishes first
        work(early, 0)
        assert exists(shared) != launched  # by hand: committed on the earlier marker
        # the late worker writes whether or not its staging directory was swapped in meanwhile
        manifest = work(late, 1)
        assert read_manifest(shared).content_hash == expected
        assert manifest.extra.get("partial", False) != launched
