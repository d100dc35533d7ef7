"""Which content hash a manifest records for large files: sha256 (every manifest before this one)
against xxh3-128 (xxhash) and, when installed, BLAKE3, on bytes in memory (one thread; the figure
is the hash, not the disk).

    python benchmarks/bench_hash.py [--mb 256] [--repeat 5]

A 7B bf16 policy is 14 GB: at sha256's speed here every full pass over it costs seconds, and a
checkpoint is hashed when written and verified where it is read. rlpipe records xxh3-128 for
files from `schemas.hashing.FAST_HASH_MIN_BYTES` up and sha256 below (manifests name the
algorithm per file; manifests written with sha256 still verify).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    data = os.urandom(args.mb << 20)
    import xxhash

    algorithms = {"sha256": lambda b: hashlib.sha256(b).hexdigest(),
                  "xxh3_128": lambda b: xxhash.xxh3_128(b).hexdigest()}
    try:
        import blake3

        algorithms["blake3 (1 thread)"] = lambda b: blake3.blake3(b).hexdigest()
    except ImportError:
        pass
    speeds = {}
    for name, fn in algorithms.items():
        best = min(_time(fn, data) for _ in range(args.repeat))
        speeds[name] = len(data) / best / 1e9
    print(f"{'hash':<20} {'GB/s':>7} {'x sha256':>9} {'s per 14 GB (7B bf16)':>22}")
    for name, gbs in speeds.items():
        print(f"{name:<20} {gbs:>7.2f} {gbs / speeds['sha256']:>8.1f}x {14 / gbs:>22.1f}")


def _time(fn, data: bytes) -> float:
    started = time.perf_counter()
    fn(data)
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
