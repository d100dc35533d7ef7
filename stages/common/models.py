"""Loading Hugging Face checkpoints, with an in-process cache keyed by checkpoint content.

On one machine the local runner keeps models loaded between iterations (docs/design.md#local-runner, "files as the
contract, memory as a cache"): a checkpoint is keyed by the content hash in its `_manifest.json`
(or, for a directory without one, by its files' names, sizes and mtimes), so loading checkpoint X
is free when X is already in memory and gives exactly what loading from disk gives.

Cached models are shared: callers must treat them as read-only (eval mode, no optimizer steps).
A stage that trains copies the weights first (`copy.deepcopy`) or loads with `cache=False`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from rlpipe.schemas.manifest import MANIFEST_NAME
from rlpipe.schemas.verify import verify_checkpoint

_CACHE: dict[tuple[str, str], tuple[Any, Any]] = {}
_MAX_ENTRIES = 4


def checkpoint_key(path: Path | str) -> str:
    """Content identity of a checkpoint directory."""
    path = Path(path)
    manifest = path / MANIFEST_NAME
    if manifest.is_file():
        return json.loads(manifest.read_text())["content_hash"]
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(path)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def load_model(path: Path | str, kind: str = "causal", *, cache: bool = True) -> tuple[Any, Any]:
    """(model, tokenizer) from a Hugging Face directory, fp32, eval mode.

    Args:
        kind: 'causal', or 'reward' / 'critic' (a `ScalarHeadModel`: backbone + one output per
            position; see scalar_head.py).
        cache: reuse/keep the loaded model in the in-process cache.
    """
    from rlpipe.stages.common.tiny import load_checkpoint

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    verify_checkpoint(path)  # every file as its manifest promises (hashes memoised by stat)
    if not cache:
        return load_checkpoint(path, kind)  # type: ignore[arg-type]
    key = (checkpoint_key(path), kind)
    if key not in _CACHE:
        if len(_CACHE) >= _MAX_ENTRIES:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = load_checkpoint(path, kind)  # type: ignore[arg-type]
    return _CACHE[key]


def remember(path: Path | str, kind: str, model: Any, tokenizer: Any) -> None:
    """Record an in-memory model as the content of checkpoint `path` (just saved from it)."""
    if len(_CACHE) >= _MAX_ENTRIES:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[(checkpoint_key(path), kind)] = (model, tokenizer)


#: What configs call the longest sequence their positions cover (GPT-2: n_positions / n_ctx,
#: ChatGLM-style: seq_length, some: max_sequence_length), most specific first.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "seq_length", "max_sequence_length", "n_ctx")


def context_length(config: Any) -> int | None:
    """The model's context length, whatever its config (a `PretrainedConfig` or a config.json dict)
    calls it; None when it names none: ALiBi models (Bloom) have no position table to run past.

    Multimodal configs keep the language model's settings in `text_config`; that is read first.
    """
    if isinstance(config, dict):
        config = config.get("text_config") or config
        values = [config.get(k) for k in CONTEXT_KEYS]
    else:
        config = config.get_text_config()
        values = [getattr(config, k, None) for k in CONTEXT_KEYS]
    return next((int(v) for v in values if isinstance(v, int) and v > 0), None)


def clear_cache() -> None:
    _CACHE.clear()
