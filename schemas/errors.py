"""User errors, and the errors of artifact IO: one base class, a missing artifact, a shard that does
not match."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


class UserError(Exception):
    """A mistake in what the user gave (a config, a file, data, a reward function): the message
    names the file, key or row and says what to do. Command lines print it as one `error:`
    paragraph and exit 2 without a traceback (`--debug` shows it); Prefect does not retry it (the
    same input fails the same way)."""


class DataError(UserError, ValueError):
    """Rows of the user's data are refused (repeated ids, empty prompts, text that is not UTF-8,
    answers a stage cannot use): the message names the file or artifact, the column and the rows."""


class ArtifactError(UserError):
    """Base class of artifact errors (missing, incomplete, tampered or mismatched artifacts)."""


class ArtifactNotFound(ArtifactError):
    """The directory has no manifest: the artifact is missing or was never completed."""


class SchemaMismatch(ArtifactError):
    """A shard does not match its expected schema; `problems` lists each difference."""

    def __init__(self, path: Path | str, expected: str, problems: Sequence[str]):
        self.path = Path(path)
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{self.path}: does not match schema {expected!r}:\n{lines}")


class IntegrityError(ArtifactError):
    """A file differs from what its manifest promises (hash, size, rows), or a manifest from its own
    content hash: it was changed after it was written. The message names the file."""
