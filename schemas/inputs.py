"""What a stage input must be, checked before any work: an artifact of the expected schema, or a
Hugging Face checkpoint directory with a tokenizer. One message per problem, naming the path and
what to do."""

from __future__ import annotations

import json
from pathlib import Path

from rlpipe.schemas.manifest import MANIFEST_NAME

#: Files of which at least one marks a saved Hugging Face tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def input_problem(path: Path | str, kind: str) -> str | None:
    """Why `path` cannot serve as an input of `kind` (a schema name, 'checkpoint', or 'file': data
    to import); None if it can."""
    path = Path(path)
    if not path.exists():
        return f"{path} does not exist"
    if kind == "file":  # data to import: a file, or a folder saved by `datasets`
        return None
    if not path.is_dir():
        return f"{path} is a file; an artifact or checkpoint is a directory (import data files with `rlpipe data import`)"
    if kind == "checkpoint":
        if not (path / "config.json").is_file():
            return f"{path} is not a Hugging Face checkpoint (no config.json): pass a directory saved with save_pretrained"
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            return f"{path} has no tokenizer ({', '.join(TOKENIZER_FILES)}): save the tokenizer beside the model"
        return None
    manifest = path / MANIFEST_NAME
    if not manifest.is_file():
        return (f"{path} has no {MANIFEST_NAME}: it is not a complete rlpipe artifact (its stage did not "
                f"finish, or it was never imported: `rlpipe data import`)")
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        return f"{manifest} cannot be read: {e}"
    if data.get("kind") == "checkpoint":
        return f"{path} is a checkpoint, but a {kind!r} artifact is expected here"
    if data.get("schema_name") != kind:
        return f"{path} holds {data.get('schema_name')!r} rows, but a {kind!r} artifact is expected here"
    return None
