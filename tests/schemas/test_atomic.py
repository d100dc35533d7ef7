"""A writer killed mid-write (SIGKILL) leaves nothing that looks complete; a rerun completes."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlpipe.schemas import (
    ROLLOUTS,
    ArtifactNotFound,
    ArtifactWriter,
    read_table_artifact,
    validate_artifact,
)
from rlpipe.schemas.atomic import atomic_write_bytes, temp_path_for
from rlpipe.schemas.examples import example_table

# Writes 4 shards of 8 rows. Shard 0 is written normally; while writing shard 1 the Parquet
# writer stalls half way (half the file's bytes written to the path it was given), signals the
# test and sleeps, so the SIGKILL lands exactly in the middle of a shard.
WRITER = textwrap.dedent("""
    import io, sys, time
    from pathlib import Path
    import pyarrow.parquet as pq
    from rlpipe.schemas import ROLLOUTS, ArtifactWriter
    from rlpipe.schemas.examples import example_table

    out, signal_file = Path(sys.argv[1]), Path(sys.argv[2])
    real_write_table = pq.write_table

    def stalling_write_table(table, where, **kw):
        if "part-00001" not in str(where):
            return real_write_table(table, where, **kw)
        buf = io.BytesIO()
        real_write_table(table, buf, **kw)
        with open(where, "wb") as f:
            f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        signal_file.write_text(str(where))
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
    out, signal_file = tmp_path / "rollouts", tmp_path / "writing"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    proc = subprocess.Popen([sys.executable, str(script), str(out), str(signal_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for(signal_file, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL

    # The half-written shard exists only under its hidden temporary name.
    tmp = tmp_path / "rollouts" / signal_file.read_text().rsplit("/", 1)[-1]
    assert tmp.name.startswith(".part-00001.parquet.") and tmp.name.endswith(".tmp")
    assert 0 < tmp.stat().st_size
    with pytest.raises(pa.ArrowInvalid, match="magic bytes not found in footer"):  # cut before its footer
        pq.read_metadata(tmp)
    assert sorted(p.name for p in out.glob("part-*.parquet")) == ["part-00000.parquet"]
    assert pq.read_metadata(out / "part-00000.parquet").num_rows == 8  # complete, not partial
    assert not (out / "_manifest.json").exists()
    with pytest.raises(ArtifactNotFound, match="no _manifest.json"):
        read_table_artifact(out)
    assert validate_artifact(out) == [f"artifact {out} has no _manifest.json (incomplete: its stage did not finish)"]

    # Rerun (same code path, no stall): the leftovers are cleaned, the artifact is complete.
    writer = ArtifactWriter(out, ROLLOUTS, stage="test")
    assert sorted(p.name for p in out.iterdir()) == []
    for i in range(4):
        writer.write_shard(example_table(ROLLOUTS, 8, seed=i), index=i)
    manifest = writer.commit()
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


def test_opening_a_writer_removes_the_old_manifest_first(tmp_path):
    out = tmp_path / "r"
    w = ArtifactWriter(out, ROLLOUTS, stage="test")
    w.write_shard(example_table(ROLLOUTS, 4), index=0)
    w.commit()
    assert read_table_artifact(out).num_rows == 4
    ArtifactWriter(out, ROLLOUTS, stage="test")  # a rerun starts, then (say) dies
    with pytest.raises(ArtifactNotFound):
        read_table_artifact(out)
    assert list(out.glob("part-*.parquet")) == []
