"""Checkpoint directories as stage inputs (the policy of rollout / evaluate, the base of sft...)."""

from __future__ import annotations

from pathlib import Path

from rlpipe.schemas import InputRef
from rlpipe.stages.common.models import checkpoint_key


def checkpoint_input(path: Path | str, role: str = "checkpoint") -> InputRef:
    """The input reference of a Hugging Face checkpoint directory: its manifest's content hash, or
    (a directory no stage wrote) a hash of its file names, sizes and mtimes.

    Args:
        role: what the checkpoint is to the stage ("policy", "base"), for the error message.
    """
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"{role} checkpoint {path} does not exist (no config.json there)")
    return InputRef(path=str(path), content_hash=checkpoint_key(path))
