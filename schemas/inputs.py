"""What a stage input must be, checked before any work: an artifact of the expected schema, or a
Hugging Face checkpoint directory with a tokenizer. One message per problem, naming the path and
what to do."""

from __future__ import annotations

import json
import re
from pathlib import Path

from rlpipe.schemas.manifest import MANIFEST_NAME

#: Files of which at least one marks a saved Hugging Face tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


#: org/name, as the Hub spells repository ids (no leading '.', no '..'), with an optional @revision.
HUB_ID = re.compile(r"^(?P<id>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")


def hub_reference(value: Path | str) -> tuple[str, str] | None:
    """(id, revision) when `value` is no local path and reads as org/name[@revision]; else None."""
    text = str(value)
    if Path(text).exists():
        return None
    m = HUB_ID.match(text)
    return (m["id"], m["revision"] or "main") if m else None


def input_problem(path: Path | str, kind: str) -> str | None:
    """Why `path` cannot serve as an input of `kind` (a schema name, 'checkpoint', or 'file': data
    to import); None if it can."""
    path = Path(path)
    if not path.exists():
        todo = {"checkpoint": "give the directory of a Hugging Face checkpoint (saved with save_pretrained)",
                "file": "check the path"}.get(kind, "check the path, or write it first (with the stage that "
                                                    "makes it, or `rlpipe data import` for your own data)")
        return f"{path} does not exist: {todo}"
    if kind == "file":  # data to import: a file, or a folder saved by `datasets`
        return None
    if not path.is_dir():
        return f"{path} is a file; an artifact or checkpoint is a directory (import data files with `rlpipe data import`)"
    if kind == "checkpoint":
        if not (path / "config.json").is_file():
            return f"{path} is not a Hugging Face checkpoint (no config.json): pass a directory saved with save_pretrained"
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            return f"{path} has no tokenizer ({', '.join(TOKENIZER_FILES)}): save the tokenizer beside the model"
        for file in sorted(path.glob("*.json")):
            problem = json_problem(file)
            if problem:
                return problem
        for weights in sorted(path.glob("*.safetensors")):
            problem = safetensors_problem(weights)
            if problem:
                return problem
        return None
    manifest = path / MANIFEST_NAME
    if not manifest.is_file():
        return (f"{path} has no {MANIFEST_NAME}: it is not a complete rlpipe artifact (its stage did not "
                f"finish, or it was never imported: `rlpipe data import`)")
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        return f"{manifest} cannot be read: {e}"
    if kind == "train_state":  # a checkpoint directory the optimize stage wrote (extra.kind)
        if (data.get("extra") or {}).get("kind") != "train_state":
            return f"{path} is not a train_state artifact (written by the optimize stage's train_state_output)"
        return None
    if data.get("kind") == "checkpoint":
        return f"{path} is a checkpoint, but a {kind!r} artifact is expected here"
    if data.get("schema_name") != kind:
        return f"{path} holds {data.get('schema_name')!r} rows, but a {kind!r} artifact is expected here"
    return None


#: (device, inode) -> (size, mtime_ns) of JSON files found well-formed by this process.
_GOOD_JSON: dict[tuple[int, int], tuple[int, int]] = {}


def json_problem(file: Path) -> str | None:
    """Why a checkpoint's JSON file (config, tokenizer, generation config, index) cannot be read:
    not UTF-8, or not JSON; None if it parses. Parsed once per state of the file."""
    try:
        st = file.stat()
        if _GOOD_JSON.get((st.st_dev, st.st_ino)) == (st.st_size, st.st_mtime_ns):
            return None
        json.loads(file.read_bytes().decode("utf-8"))
    except OSError as e:
        return f"{file} cannot be read ({e.strerror or e}): check its permissions, or copy the checkpoint again"
    except (UnicodeDecodeError, ValueError) as e:
        return (f"{file} is not valid JSON ({e}): the checkpoint is damaged or was cut short; save it again "
                "(save_pretrained) or restore the file")
    _GOOD_JSON[(st.st_dev, st.st_ino)] = (st.st_size, st.st_mtime_ns)
    return None


def safetensors_problem(file: Path) -> str | None:
    """Why a .safetensors file cannot be loaded (cut short, or no safetensors header); None if its
    size is the one its header promises. Reads only the header.

    Layout: 8 bytes little-endian header length N, N bytes of JSON {tensor: {data_offsets:
    [begin, end], ...}}, then the data; the file is 8 + N + max(end) bytes long.
    """
    size = file.stat().st_size
    again = "copy or save the checkpoint again (save_pretrained)"
    try:
        with file.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or 8 + n > size:
                raise ValueError("header cut short")
            header = json.loads(f.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        return f"{file} ({size} bytes) is not a readable safetensors file ({e}): {again}"
    if 8 + n + end != size:
        return f"{file} is {size} bytes, but its header promises {8 + n + end} (truncated or damaged): {again}"
    return None
