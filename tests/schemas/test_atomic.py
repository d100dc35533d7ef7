"""A writer killed mid-write (SIGKILL) leaves nothing that looks complete and the previous
artifact whole; a rerun completes."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlpipe.schemas import (
    ROLLOUTS,
    ArtifactWriter,
    read_manifest,
    read_table_artifact,
    validate_artifact,
    write_table_artifact,
)
from rlpipe.schemas.atomic import atomic_write_bytes, temp_path_for
from rlpipe.schemas.examples import example_table
from rlpipe.schemas.staging import staging_path

# Writes 4 shards of 8 rows. Shard 0 is written normally; while writing shard 1 the Parquet
# writer stalls half way (half the file's bytes written to the path it was given), signals the
# test and sleeps, so the SIGKILL lands exactly in the middle of a shard.
WRITER = textwrap.dedent("""
    import io, sys, time
    from pathlib import Path
    import pyarrow.parquet as pq
    from rlpipe.schemas import ROLLOUTS, ArtifactWriter
    from rlpipe.schemas.examples import example_table

    out, signal_file, pid_file = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    pid_file.write_text(str(__import__("os").getpid()))
    real_write_table = pq.write_table

    def stalling_write_table(table, where, **kw):
        name = str(getattr(where, "name", where))  # (a path, or the file the writer hashes through)
        if "part-00001" not in name:
            return real_write_table(table, where, **kw)
        buf = io.BytesIO()
        real_write_table(table, buf, **kw)
        with open(name, "wb") as f:
            f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        signal_file.write_text(name)
        time.sleep(600)

    pq.write_table = stalling_write_table
    writer = ArtifactWriter(out, ROLLOUTS, stage="test")
    for i in range(4):
        writer.write_shard(example_table(ROLLOUTS, 8, seed=i), index=i)
        time.sleep(0.05)
    writer.commit()
""")


def _wait_for(path, proc, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"writer exited early: {proc.communicate()}"
        assert time.monotonic() < deadline, "writer never reached shard 1"
        time.sleep(0.02)


def test_killed_writer_leaves_no_artifact_and_rerun_completes(tmp_path):
    out, signal_file, pid_file = tmp_path / "rollouts", tmp_path / "writing", tmp_path / "pid"
    old = ArtifactWriter(out, ROLLOUTS, stage="test")  # a complete artifact, then a rerun over it
    old.write_shard(example_table(ROLLOUTS, 5, seed=7), index=0)
    old_hash = old.commit().content_hash
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    proc = subprocess.Popen([sys.executable, str(script), str(out), str(signal_file), str(pid_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for(signal_file, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL

    # The half-written shard exists only under its hidden temporary name, in the killed writer's
    # private staging directory; the artifact at `out` is the old one, whole.
    staging = staging_path(out).with_name(f"{staging_path(out).name.rsplit('-', 1)[0]}-{pid_file.read_text()}")
    tmp = Path(signal_file.read_text())
    assert tmp.parent == staging
    assert tmp.name.startswith(".part-00001.parquet.") and tmp.name.endswith(".tmp")
    assert 0 < tmp.stat().st_size
    with pytest.raises(pa.ArrowInvalid, match="magic bytes not found in footer"):  # cut before its footer
        pq.read_metadata(tmp)
    assert sorted(p.name for p in staging.glob("part-*.parquet")) == ["part-00000.parquet"]
    assert pq.read_metadata(staging / "part-00000.parquet").num_rows == 8  # complete, not partial
    assert not (staging / "_manifest.json").exists()
    assert read_manifest(out).content_hash == old_hash and validate_artifact(out) == []
    assert read_table_artifact(out).to_pylist() == example_table(ROLLOUTS, 5, seed=7).to_pylist()

    # Rerun (same code path, no stall): the dead writer's staging is removed, the artifact replaced.
    writer = ArtifactWriter(out, ROLLOUTS, stage="test")
    assert not staging.exists() and sorted(p.name for p in writer.staging.iterdir()) == []
    for i in range(4):
        writer.write_shard(example_table(ROLLOUTS, 8, seed=i), index=i)
    manifest = writer.commit()
    assert not writer.staging.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert manifest.rows == 32 and manifest.shard_names == [f"part-0000{i}.parquet" for i in range(4)]
    table = read_table_artifact(out)
    assert table.to_pylist() == [r for i in range(4) for r in example_table(ROLLOUTS, 8, seed=i).to_pylist()]
    assert validate_artifact(out) == []


def test_temporary_names_are_hidden_and_per_process(tmp_path):
    tmp = temp_path_for(tmp_path / "part-00003.parquet")
    assert tmp.name == f".part-00003.parquet.{os.getpid()}.tmp"
    assert not tmp.match("part-*.parquet")
    atomic_write_bytes(tmp_path / "x.bin", b"abc")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin"]
    assert (tmp_path / "x.bin").read_bytes() == b"abc"


def test_a_failed_rewrite_leaves_the_old_artifact_whole(tmp_path):
    out = tmp_path / "r"
    w = ArtifactWriter(out, ROLLOUTS, stage="test")
    w.write_shard(example_table(ROLLOUTS, 4), index=0)
    w.commit()
    before = sorted((p.name, p.read_bytes()) for p in out.iterdir())
    rerun = ArtifactWriter(out, ROLLOUTS, stage="test")  # a rerun starts, writes, then (say) dies
    rerun.write_shard(example_table(ROLLOUTS, 6, seed=3), index=0)
    rerun.write_shard(example_table(ROLLOUTS, 6, seed=4), index=1)
    assert sorted((p.name, p.read_bytes()) for p in out.iterdir()) == before
    assert read_table_artifact(out).num_rows == 4 and validate_artifact(out) == []
    # the next writer of this process starts from a fresh staging directory
    again = ArtifactWriter(out, ROLLOUTS, stage="test")
    again.write_shard(example_table(ROLLOUTS, 3), index=0)
    assert again.commit().rows == 3 and read_table_artifact(out).num_rows == 3
    assert list(out.glob("part-*.parquet")) == [out / "part-00000.parquet"]


def test_commit_swaps_atomically_and_keeps_nested_artifacts(tmp_path):
    """The evaluate stage writes eval/rollouts and eval/scores, then commits eval itself."""
    out = tmp_path / "eval"
    write_table_artifact(out / "rollouts", ROLLOUTS, example_table(ROLLOUTS, 2), stage="test")
    write_table_artifact(out, ROLLOUTS, example_table(ROLLOUTS, 3), stage="test")
    assert read_table_artifact(out / "rollouts").num_rows == 2 and read_table_artifact(out).num_rows == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval"]  # no staging left beside it
