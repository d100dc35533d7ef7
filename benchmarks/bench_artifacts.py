"""Artifact IO throughput: our writer/readers against plain pyarrow.parquet, side by side.

    python benchmarks/bench_artifacts.py [--rows 100000] [--tokens 256] [--repeats 3]

Builds a rollouts table (random token ids and log-probs, prompts of ~64 tokens, responses of
`--tokens` tokens, groups of 8), then, alternating, `--repeats` times each:
  ours   write: ArtifactWriter, ~10k-row shards cut on group boundaries, validation, sha256, manifest
  plain  write: pyarrow.parquet.write_table of the same table (one file, and the same shards)
  ours   read : read_table_artifact (schema + null checks per shard) and scan_artifact().collect()
  plain  read : pyarrow.parquet.read_table (the one file; the shards, concatenated), and
               polars.read_parquet of the one file (the baseline of scan_artifact)
Then the same shard by shard, ours and plain back to back (the figure least disturbed by other
load on a shared machine). Best-of-N wall seconds and process CPU seconds (all threads; less sensitive to other load on a
shared machine); throughput in MB/s of on-disk Parquet bytes and of in-memory Arrow bytes
(`Table.nbytes`), from wall time. Files are read back from the page cache: reads measure
decoding, not the disk.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from rlpipe.schemas import (
    ROLLOUTS,
    ArtifactWriter,
    read_shard,
    read_table_artifact,
    scan_artifact,
    shard_name,
    split_rows,
)

GROUP = 8
WORDS = np.array("the of and a to in is that for it as was with be by on not he this are or his "
                 "from at which but have an they you were her she there been one all we their "
                 "1 2 3 4 5 6 7 8 9 0 + = answer so then".split())


def _list(lengths: np.ndarray, values: np.ndarray, type_: pa.DataType) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)).cast(type_)


def _texts(rng: np.random.Generator, n: int, words: int) -> pa.Array:
    pool = [" ".join(rng.choice(WORDS, size=words)) for _ in range(997)]
    return pa.array([pool[i] for i in rng.integers(0, len(pool), size=n)], pa.string())


def rollouts_table(rows: int, tokens: int, seed: int = 0) -> pa.Table:
    """A rollouts table of realistic shape: prompts ~64 tokens, responses `tokens` tokens."""
    rng = np.random.default_rng(seed)
    groups = np.arange(rows) // GROUP
    prompt_len = np.repeat(rng.integers(32, 97, size=rows // GROUP + 1), GROUP)[:rows]
    resp_len = np.full(rows, tokens)
    n_prompt, n_resp = int(prompt_len.sum()), int(resp_len.sum())
    sampling = pa.StructArray.from_arrays(
        [pa.array(np.full(rows, 1.0, np.float32)), pa.array(np.full(rows, 1.0, np.float32)),
         pa.array(np.full(rows, -1, np.int32)), pa.array(np.full(rows, tokens, np.int32))],
        fields=list(ROLLOUTS.column("sampling").type),
    )
    cols = {
        "run": pa.array(["bench"] * rows),
        "iteration": pa.array(np.zeros(rows, np.int32)),
        "policy_version": pa.array(np.zeros(rows, np.int32)),
        "prompt_id": pa.array([f"p{g:07d}" for g in groups]),
        "group_id": pa.array(groups.astype(np.int64)),
        "sample_index": pa.array((np.arange(rows) % GROUP).astype(np.int32)),
        "prompt": _texts(rng, rows, 48),
        "prompt_token_ids": _list(prompt_len, rng.integers(0, 32000, n_prompt, dtype=np.int32), pa.list_(pa.int32())),
        "answer": pa.array([str(g % 100) for g in groups]),
        "response": _texts(rng, rows, tokens * 3 // 4),
        "response_token_ids": _list(resp_len, rng.integers(0, 32000, n_resp, dtype=np.int32), pa.list_(pa.int32())),
        "response_logprobs": _list(resp_len, -rng.exponential(1.0, n_resp).astype(np.float32), pa.list_(pa.float32())),
        "finish_reason": pa.array(rng.choice(["stop", "length"], size=rows, p=[0.8, 0.2])),
        "sampling": sampling,
        "engine": pa.array(["vllm"] * rows),
        "seed": pa.array(groups.astype(np.int64) + 1234),
    }
    return pa.table(cols, schema=ROLLOUTS.arrow())


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def paired_per_shard(parts: list[pa.Table], ours: Path, plain: Path, repeats: int):
    """Best wall seconds per shard of ours vs plain, measured back to back: (write ours, write
    plain, commit, read ours, read plain), each summed over shards."""
    inf = float("inf")
    best = {k: [inf] * len(parts) for k in ("w_ours", "w_plain", "r_ours", "r_plain")}
    commit = inf
    for rep in range(repeats):
        writer = ArtifactWriter(ours, ROLLOUTS, stage="bench")
        for i, part in enumerate(parts):
            jobs = [("w_ours", partial(writer.write_shard, part, index=i)),
                    ("w_plain", partial(pq.write_table, part, plain / shard_name(i)))]
            for key, fn in jobs if (rep + i) % 2 == 0 else jobs[::-1]:
                best[key][i] = min(best[key][i], timed(fn)[0])
        commit = min(commit, timed(writer.commit)[0])
        for i in range(len(parts)):
            jobs = [("r_ours", partial(read_shard, ours / shard_name(i), ROLLOUTS)),
                    ("r_plain", partial(pq.read_table, plain / shard_name(i)))]
            for key, fn in jobs if (rep + i) % 2 == 0 else jobs[::-1]:
                best[key][i] = min(best[key][i], timed(fn)[0])
    return (sum(best["w_ours"]), sum(best["w_plain"]), commit, sum(best["r_ours"]), sum(best["r_plain"]))


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.suffix == ".parquet")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--tokens", type=int, default=256, help="response tokens per row")
    ap.add_argument("--rows-per-shard", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args()

    t0 = time.perf_counter()
    table = rollouts_table(args.rows, args.tokens)
    arrow_mb = table.nbytes / 1e6
    print(f"table: {args.rows} rows x {args.tokens} response tokens, {arrow_mb:.0f} MB in Arrow memory "
          f"(built in {time.perf_counter() - t0:.1f} s)")

    scratch = Path(tempfile.mkdtemp(dir=args.dir, prefix="bench_artifacts_"))
    ours, plain, plain10 = scratch / "ours", scratch / "plain.parquet", scratch / "plain10"
    plain10.mkdir()
    parts = list(split_rows(table, "group_id", args.rows_per_shard))

    def write_ours():
        w = ArtifactWriter(ours, ROLLOUTS, stage="bench")
        for i, part in enumerate(parts):
            w.write_shard(part, index=i)
        w.commit()

    def write_plain():
        pq.write_table(table, plain)

    def write_plain10():
        for i, part in enumerate(parts):
            pq.write_table(part, plain10 / f"part-{i:05d}.parquet")

    def read_plain10():
        return pa.concat_tables([pq.read_table(p) for p in sorted(plain10.glob("*.parquet"))])

    try:
        results: dict[str, float] = {}
        cpu: dict[str, float] = {}

        def record(name: str, fn: Callable[[], object]) -> None:
            wall, c = timed(fn)
            results[name] = min(results.get(name, float("inf")), wall)
            cpu[name] = min(cpu.get(name, float("inf")), c)

        for _ in range(args.repeats):  # alternate so that machine load hits both alike
            for name, fn in (("write ours", write_ours), ("write plain", write_plain),
                             ("write plain (same shards)", write_plain10)):
                record(name, fn)
        disk_ours, disk_plain, disk_plain10 = dir_bytes(ours), plain.stat().st_size, dir_bytes(plain10)
        check = read_table_artifact(ours)
        assert check.num_rows == args.rows and check.column("response_token_ids").equals(
            table.column("response_token_ids")), "round trip changed the data"
        del check
        for _ in range(args.repeats):
            for name, fn in (("read ours (read_table_artifact)", lambda: read_table_artifact(ours)),
                             ("read ours (scan_artifact.collect)", lambda: scan_artifact(ours).collect()),
                             ("read plain (pq.read_table)", lambda: pq.read_table(plain)),
                             ("read plain (pl.read_parquet)", lambda: pl.read_parquet(plain)),
                             ("read plain (same shards)", read_plain10)):
                record(name, fn)
        paired = paired_per_shard(parts, ours, plain10, args.repeats)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    print(f"on disk (snappy): ours {disk_ours / 1e6:.0f} MB in {len(parts)} shards, plain "
          f"{disk_plain / 1e6:.0f} MB in 1 file, {disk_plain10 / 1e6:.0f} MB in {len(parts)} files; "
          f"best of {args.repeats}")
    print(f"{'operation':36s} {'wall s':>7s} {'CPU s':>7s} {'disk MB/s':>10s} {'Arrow MB/s':>11s}")
    for name, s in results.items():
        disk = disk_ours if "ours" in name else disk_plain10 if "same shards" in name else disk_plain
        print(f"{name:36s} {s:7.3f} {cpu[name]:7.3f} {disk / 1e6 / s:10.0f} {arrow_mb / s:11.0f}")
    print("overhead ratios, ours / plain (wall time; CPU time):")
    for label, ours_, plain_ in (
        ("write vs 1 plain file", "write ours", "write plain"),
        ("write vs plain, same shards", "write ours", "write plain (same shards)"),
        ("read_table_artifact vs 1 plain file", "read ours (read_table_artifact)", "read plain (pq.read_table)"),
        ("read_table_artifact vs plain, same shards", "read ours (read_table_artifact)", "read plain (same shards)"),
        ("scan_artifact.collect vs pl.read_parquet", "read ours (scan_artifact.collect)", "read plain (pl.read_parquet)"),
    ):
        print(f"  {label:40s} {results[ours_] / results[plain_]:5.2f}x; {cpu[ours_] / cpu[plain_]:5.2f}x")
    w_ours, w_plain, commit, r_ours, r_plain = paired
    print("paired shard by shard (each shard by ours and by plain back to back, order alternating, "
          "per-shard best summed; the least load-sensitive figure):")
    print(f"  write: ours {w_ours + commit:.3f} s (manifest {commit:.3f} s), plain {w_plain:.3f} s "
          f"-> {(w_ours + commit) / w_plain:.2f}x")
    print(f"  read : ours (read_shard) {r_ours:.3f} s, plain (pq.read_table) {r_plain:.3f} s "
          f"-> {r_ours / r_plain:.2f}x")


if __name__ == "__main__":
    main()
