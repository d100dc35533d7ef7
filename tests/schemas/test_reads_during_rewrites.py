"""A read of an artifact that another process rewrites (`rlpipe stage score --force`) returns one
version whole, or fails with IntegrityError; never rows of two versions, and never bytes it did not
verify.

A writer process swaps two complete versions of a scores artifact in and out of its path with the
directory exchange a `--force` rewrite makes (`rlpipe.schemas.staging`), thousands of times, then
rewrites it for real (`write_table_artifact`, staging + swap, the old copy removed) a while longer,
while this process reads it in a loop through every whole-artifact reader and compares each result
with the two versions' known rows."""

from __future__ import annotations

import subprocess
import sys
import time

import pyarrow as pa
import pytest

from rlpipe.schemas import (
    SCORES,
    iter_shards,
    read_table_artifact,
    scan_artifact,
    write_table_artifact,
)
from rlpipe.schemas.errors import IntegrityError
from rlpipe.schemas.examples import example_table
from rlpipe.schemas.verify import known_hash

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

FLIP_S, REWRITE_S = 10.0, 3.0

# Flips: the exchange alone (not swap_into_place, which then deletes the old copy), so that both
# versions' files stay older than the hash memo's racy window, as those of a real rerun (seconds
# long) are when a reader meets them: the reader trusts its memo, which is where a read that
# re-opens a path by name went wrong. Rewrites: the real thing, fresh files each time.
WRITER = """
import random, sys, time
from pathlib import Path
from rlpipe.schemas import SCORES, write_table_artifact
from rlpipe.schemas.examples import example_table
from rlpipe.schemas.staging import _exchange

path, spare, flip_s, rewrite_s = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
rng, flips, rewrites = random.Random(0), 0, 0
end = time.monotonic() + flip_s
while time.monotonic() < end:
    assert _exchange(spare, path)
    flips += 1
    time.sleep(rng.uniform(0, 0.002))  # about as long as a read: some land inside one, some not
end = time.monotonic() + rewrite_s
while time.monotonic() < end:
    write_table_artifact(path, SCORES, example_table(SCORES, 16, seed=rewrites % 2), stage="score",
                         rows_per_shard=4, shard_by="group_id")
    rewrites += 1
print(flips, rewrites)
"""


def _versions(tmp_path):
    """The scores artifact (version 0) and a hidden sibling holding version 1, both complete and
    past the racy window; the two versions' tables as every reader returns them."""
    path, spare = tmp_path / "scores", tmp_path / ".scores.v1"
    for p, seed in ((path, 0), (spare, 1)):
        write_table_artifact(p, SCORES, example_table(SCORES, 16, seed=seed), stage="score",
                             rows_per_shard=4, shard_by="group_id")
    time.sleep(1.1)
    tables = [read_table_artifact(path), read_table_artifact(spare)]
    assert known_hash(path / "part-00003.parquet") is not None  # remembered: reads trust the memo
    assert len({t.column("reward")[15].as_py() for t in tables}) == 2  # the last shard differs too
    return path, spare, tables


READERS = {
    "read_table_artifact": read_table_artifact,
    "scan_artifact": lambda p: scan_artifact(p).collect().to_arrow(),
    "iter_shards": lambda p: pa.concat_tables([t for _, t in iter_shards(p)]),
}


def _same(table: pa.Table, version: pa.Table) -> bool:
    return table.num_rows == version.num_rows and table.select(version.column_names).to_pylist() == version.to_pylist()


def test_a_read_during_force_rewrites_returns_one_version_or_fails(tmp_path):
    path, spare, versions = _versions(tmp_path)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(spare), str(FLIP_S), str(REWRITE_S)],
                              stdout=subprocess.PIPE, text=True)
    outcomes = {name: {"v0": 0, "v1": 0, "IntegrityError": 0, "mixed": 0, "other": 0} for name in READERS}
    while writer.poll() is None:
        for name, read in READERS.items():
            try:
                table = read(path)
            except IntegrityError:
                outcomes[name]["IntegrityError"] += 1
                continue
            except Exception as e:  # a read that fails some other way (not an artifact error)
                outcomes[name]["other"] += 1
                outcomes[name].setdefault("errors", set()).add(f"{type(e).__name__}: {e}"[:120])
                continue
            seen = next((f"v{i}" for i, v in enumerate(versions) if _same(table, v)), "mixed")
            outcomes[name][seen] += 1
    flips, rewrites = map(int, writer.communicate()[0].split())
    print(f"{flips} flips, {rewrites} rewrites: {outcomes}")
    assert writer.returncode == 0 and flips > 500 and rewrites > 5
    for name, seen in outcomes.items():
        assert seen["mixed"] == 0, f"{name} returned rows of two versions: {seen}"
        assert seen["other"] == 0, f"{name} failed with other than IntegrityError: {seen}"
        assert seen["v0"] > 10 and seen["v1"] > 10, f"{name} hardly read the artifact whole: {seen}"
