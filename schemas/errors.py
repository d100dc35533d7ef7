"""User errors, and the errors of artifact IO: one base class, a missing artifact, a shard that does
not match."""

from __future__ import annotations

import errno
from collections.abc import Sequence
from pathlib import Path

#: Exit codes of every rlpipe command line (`rlpipe`, `python -m rlpipe.stages.<name>`, a
#: resident worker): 0 done; 1 a bug in rlpipe (its traceback and a note saying so); 2 a user
#: error or a problem of the user's machine with what it was given (a full disk, a permission,
#: a damaged file); 3 a machine failure (a process of the run was lost); 130 / 143 interrupted
#: (SIGINT / SIGTERM). 2 and 3 print one `error:` paragraph, the traceback only with `--debug`.
EXIT_BUG, EXIT_USER, EXIT_MACHINE = 1, 2, 3


class UserError(Exception):
    """A mistake in what the user gave (a config, a file, data, a reward function): the message
    names the file, key or row and says what to do. Command lines print it as one `error:`
    paragraph and exit 2 without a traceback (`--debug` shows it); Prefect does not retry it (the
    same input fails the same way)."""


class MachineError(Exception):
    """A machine failure: a process of the run was lost (killed by a signal: the OOM killer, a
    preemption, a node that went away) while rlpipe and the user's input were fine. The message
    names the stage, the process and its log, and says that the same command resumes. Command
    lines print it as one `error:` paragraph and exit 3 (EXIT_MACHINE) without a traceback
    (`--debug` shows it); the stage's retries (`rlpipe.stages.Stage.retries`) apply to it, in
    Prefect and in the local runner alike."""


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


class SchemaVersionError(SchemaMismatch):
    """A shard of another version of its schema than this rlpipe reads, which differs in more
    than the nullable columns added since (those read as null)."""

    def __init__(self, path: Path | str, expected, version: int, problems: Sequence[str]):
        self.path, self.problems, self.version = Path(path), list(problems), version
        lines = "\n".join(f"  - {p}" for p in self.problems)
        if version > expected.version:
            todo = (f"it was written by a newer rlpipe (schema {expected.name!r} v{version}; this one reads up to "
                    f"v{expected.version}): upgrade rlpipe")
        else:
            todo = (f"it was written under schema {expected.name!r} v{version}, which this rlpipe (v{expected.version}) "
                    "cannot read as it is: write it again with this rlpipe, by rerunning the stage that made it "
                    "(`rlpipe stage NAME -c <its configs/NAME.yaml> --force`; imported data: `rlpipe data import "
                    "SOURCE OUT --force`)")
        ArtifactError.__init__(self, f"{self.path}: {todo}:\n{lines}")


class IntegrityError(ArtifactError):
    """A file differs from what its manifest promises (hash, size, rows), or a manifest from its own
    content hash: it was changed after it was written. The message names the file."""


#: Printed after the traceback of an error that is rlpipe's own fault.
BUG_NOTE = ("this is a bug in rlpipe, not a problem with what you gave it: please report it with the command "
            "you ran, the traceback above and the library versions a manifest of the run records "
            "(`library_versions`, `code_version`)")

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def user_message(e: BaseException) -> str | None:
    """What the user reads for an error caused by what they gave or by their machine (a user
    mistake, a full disk, a permission, a read-only filesystem, a damaged file), naming the file;
    None for a bug in rlpipe (shown with its traceback and BUG_NOTE). The one place every command
    line turns an exception into what the user sees."""
    if isinstance(e, UserError):
        return str(e)
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":  # (torch's: a RuntimeError)
        return ("out of memory: use a smaller model, batch (micro_batch_size, rollout.batch_size) or "
                "fewer workers per machine")
    if isinstance(e, OSError):
        where = e.filename or "a file"
        what = e.strerror or str(e)
        if e.errno in _NO_SPACE:
            return (f"no space left on the device holding {where}: free space (`rlpipe prune RUN`, a smaller "
                    "`keep:`) or write the run elsewhere (--run-dir); what was complete is kept, rerun to resume")
        if e.errno in (errno.EACCES, errno.EPERM):
            return f"permission denied: {where} ({what}): make it readable/writable, or use another path"
        if e.errno == errno.EROFS:
            return f"{where} is on a read-only filesystem: write the run to a writable directory (--run-dir)"
        if e.errno == errno.EIO:
            return f"input/output error on {where}: the disk or network filesystem failed; check it and rerun"
        if e.filename is not None:
            return f"{where}: {what}"
    if "No space left on device" in str(e):  # (libraries' own wrappers: torch, safetensors)
        return f"no space left on device ({e}): free space or write the run elsewhere (--run-dir); rerun to resume"
    return None
