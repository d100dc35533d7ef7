"""Artifact IO throughput: our writer/readers against plain pyarrow.parquet, side by side.

    python benchmarks/bench_artifacts.py [--rows 100000] [--tokens 256] [--repeats 3]

Builds a rollouts table (random token ids and log-probs, prompts of ~64 tokens, responses of
`--tokens` tokens, groups of 8), then, alternating, `--repeats` times each:
  ours   write: ArtifactWriter, ~10k-row shards cut on group boundaries, validation, sha256, manifest
  plain  write: pyarrow.parquet.write_table of the same table (one file, and 10 files)
  ours   read : read_table_artifact (schema + null checks per shard) and scan_artifact().collect()
  plain  read : pyarrow.parquet.read_table
Best-of-N seconds; throughput in MB/s of on-disk Parquet bytes and of in-memory Arrow bytes
(`Table.nbytes`). Files are read back from the page cache: reads measure decoding, not the disk.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rlpipe.schemas import ROLLOUTS, ArtifactWriter, read_table_artifact, scan_artifact, split_rows

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


def best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


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

    try:
        results: dict[str, float] = {}
        for _ in range(args.repeats):  # alternate so that machine load hits both alike
            for name, fn in (("write ours", write_ours), ("write plain", write_plain),
                             ("write plain 10 files", write_plain10)):
                results[name] = min(results.get(name, float("inf")), best(fn, 1))
        disk_ours, disk_plain = dir_bytes(ours), plain.stat().st_size
        check = read_table_artifact(ours)
        assert check.num_rows == args.rows and check.column("response_token_ids").equals(
            table.column("response_token_ids")), "round trip changed the data"
        del check
        for _ in range(args.repeats):
            for name, fn in (("read ours (read_table_artifact)", lambda: read_table_artifact(ours)),
                             ("read ours (scan_artifact.collect)", lambda: scan_artifact(ours).collect()),
                             ("read plain (pq.read_table)", lambda: pq.read_table(plain))):
                results[name] = min(results.get(name, float("inf")), best(fn, 1))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    print(f"on disk: ours {disk_ours / 1e6:.0f} MB in {len(parts)} shards, plain {disk_plain / 1e6:.0f} MB "
          f"(snappy); best of {args.repeats}")
    print(f"{'operation':36s} {'seconds':>8s} {'disk MB/s':>10s} {'Arrow MB/s':>11s}")
    for name, s in results.items():
        disk = disk_plain if "plain" in name else disk_ours
        print(f"{name:36s} {s:8.3f} {disk / 1e6 / s:10.0f} {arrow_mb / s:11.0f}")
    print("overhead (ours / plain, time):")
    print(f"  write                     {results['write ours'] / results['write plain']:.2f}x "
          f"(vs 10 plain files: {results['write ours'] / results['write plain 10 files']:.2f}x)")
    print(f"  read  read_table_artifact {results['read ours (read_table_artifact)'] / results['read plain (pq.read_table)']:.2f}x")
    print(f"  read  scan_artifact       {results['read ours (scan_artifact.collect)'] / results['read plain (pq.read_table)']:.2f}x")


if __name__ == "__main__":
    main()
