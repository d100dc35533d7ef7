"""The content hash of an artifact's files, at memory speed.

Every file of every artifact is hashed when written and verified where it is read. A 7B bf16
policy is 14 GB: at sha256's 1.8 GB/s on one core here that is ~8 s a pass, on every iteration's
critical path. Manifests now record xxh3-128 (the `xxhash` package: ~23 GB/s here, 13x sha256,
`benchmarks/bench_hash.py`), a non-cryptographic 128-bit hash: it detects a changed, torn or
swapped file (what verification is for), not a forger who can also rewrite the manifest. Each file
entry names its algorithm (`FileInfo.xxh3_128` or `FileInfo.sha256`), so manifests written before
keep verifying as they are, and the artifact's content hash, computed over the entries, is unchanged
for them.

A writer hashes the bytes as it produces them (`Hasher` fed in pieces, or `digest_bytes` of a
buffer), never by reading back a file it just wrote.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Literal

import xxhash

Algorithm = Literal["xxh3_128", "sha256"]
#: What new manifests record for every file.
WRITTEN: Algorithm = "xxh3_128"
#: Bytes read per update when hashing a file.
CHUNK = 8 << 20


def new_hasher(algorithm: Algorithm = WRITTEN):
    """An incremental hasher (`update(bytes)`, `hexdigest()`) of `algorithm`."""
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown hash algorithm {algorithm!r}")


def digest_bytes(data: bytes | memoryview, algorithm: Algorithm = WRITTEN) -> str:
    """The hex digest of `data`."""
    h = new_hasher(algorithm)
    h.update(data)
    return h.hexdigest()


def digest_file(path: Path | str, algorithm: Algorithm = WRITTEN) -> str:
    """The hex digest of a file's bytes, read in CHUNK pieces."""
    h = new_hasher(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def tagged(algorithm: Algorithm, hexdigest: str) -> str:
    """A digest with its algorithm: '<hex>' for sha256 (as manifests always wrote it),
    'xxh3_128:<hex>' otherwise. What an artifact's content hash covers and the verification memo
    holds, so digests of two algorithms never compare equal."""
    return hexdigest if algorithm == "sha256" else f"{algorithm}:{hexdigest}"


class HashingWriter(io.RawIOBase):
    """A binary file to write through (e.g. `pq.write_table(table, HashingWriter(f))`) that hashes
    the bytes on their way to `f`: the file's digest without reading it back."""

    def __init__(self, f, algorithm: Algorithm = WRITTEN):
        super().__init__()
        self.f, self.algorithm = f, algorithm
        self.hasher = new_hasher(algorithm)
        self.size = 0

    @property
    def name(self) -> str:
        """The name of the file written (as a file object's)."""
        return self.f.name

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.hasher.update(data)
        self.size += len(data)
        return self.f.write(data)

    def hexdigest(self) -> str:
        return self.hasher.hexdigest()
