"""Loading Hugging Face checkpoints, with an in-process cache keyed by checkpoint content.

On one machine the local runner keeps models loaded between iterations (docs/design.md#local-runner, "files as the
contract, memory as a cache"): a checkpoint is keyed by the content hash in its `_manifest.json`
(or, for a directory without one, by its files' names, sizes and mtimes), so loading checkpoint X
is free when X is already in memory and gives exactly what loading from disk gives.

Cached models are shared: callers must treat them as read-only (eval mode, no optimizer steps).
A stage that trains copies the weights first (`copy.deepcopy`) or loads with `cache=False`.

A slot (`load_model(..., slot="rollout")`) is a model a stage owns across calls, never shared
through the cache: on a cache miss, a slot holding a model of the same architecture (config and
tokenizer files) gets the new checkpoint's weights copied into it in place, instead of a new model
being built. A resident rollout worker gets a new policy every iteration: copying ~P parameters
from safetensors costs a fraction of building the model and loading them (`bench_scale.py`).
Never shared, because in one process the reference stage may hold the cached start policy while
the rollout slot moves on to the next policy.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlpipe.schemas.manifest import MANIFEST_NAME
from rlpipe.schemas.verify import verify_checkpoint

_CACHE: dict[tuple[str, str], tuple[Any, Any]] = {}
_MAX_ENTRIES = 4
#: slot name -> what it holds (see the module doc).
_SLOTS: dict[str, Slot] = {}
#: slot name -> how its caller's last load got the model ('cache' or a `Slot.how`).
_LAST_LOAD: dict[str, str] = {}


@dataclass
class Slot:
    """A stage's own model: which checkpoint (content key) and architecture it holds."""

    key: str
    architecture: str
    kind: str
    model: Any
    tokenizer: Any
    how: str = "loaded"
    """How the last `load_model` into the slot got its weights: 'loaded' (built from the
    checkpoint), 'in_place' (copied into the slot's model), 'held' (it held them already)."""


def checkpoint_key(path: Path | str) -> str:
    """Content identity of a checkpoint directory (a pruned one's: the content it had)."""
    from rlpipe.schemas.pending import pending_manifest
    from rlpipe.schemas.pruning import PRUNED_NAME

    path = Path(path)
    manifest = path / MANIFEST_NAME
    if manifest.is_file():
        return json.loads(manifest.read_text())["content_hash"]
    if (decided := pending_manifest(path)) is not None:  # being written by this process
        return decided.content_hash
    if (path / PRUNED_NAME).is_file():
        return json.loads((path / PRUNED_NAME).read_text())["manifest"]["content_hash"]
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(path)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def load_model(path: Path | str, kind: str = "causal", *, cache: bool = True,
               slot: str | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) from a Hugging Face directory, fp32, eval mode.

    Args:
        kind: 'causal', or 'reward' / 'critic' (a `ScalarHeadModel`: backbone + one output per
            position; see scalar_head.py).
        cache: reuse/keep the loaded model in the in-process cache.
        slot: on a cache miss, load into this slot of the caller's (see the module doc) instead
            of the cache.
    """
    from rlpipe.schemas.pending import pending_manifest
    from rlpipe.stages.common.tiny import load_checkpoint

    path = Path(path)
    if cache and pending_manifest(path) is not None and (checkpoint_key(path), kind) in _CACHE:
        # the policy optimize just handed over in memory, its files still being written (handoff.py)
        if slot is not None:
            _LAST_LOAD[slot] = "cache"
        return _CACHE[(checkpoint_key(path), kind)]
    if not path.is_dir() and pending_manifest(path) is None:
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    verify_checkpoint(path)  # every file as its manifest promises (hashes memoised by stat); waits for a pending write
    if not cache:
        return load_checkpoint(path, kind)  # type: ignore[arg-type]
    key = (checkpoint_key(path), kind)
    if slot is not None:
        if key in _CACHE:  # (the local runner: the checkpoint optimize just saved, from memory)
            _LAST_LOAD[slot] = "cache"
            return _CACHE[key]
        held = load_into_slot(slot, path, kind, key[0])
        _LAST_LOAD[slot] = held.how
        return held.model, held.tokenizer
    if key not in _CACHE:
        if len(_CACHE) >= _MAX_ENTRIES:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = load_checkpoint(path, kind)  # type: ignore[arg-type]
    return _CACHE[key]


def load_into_slot(slot: str, path: Path, kind: str, key: str) -> Slot:
    """The slot holding checkpoint `path` (content `key`): as it is, with the weights copied in
    place (same architecture and kind), or with a newly loaded model."""
    from rlpipe.stages.common.tiny import load_checkpoint

    held, arch = _SLOTS.get(slot), architecture(path)
    if held is not None and held.kind == kind and held.architecture == arch:
        if held.key != key:
            copy_weights(held.model, path)
            held.key, held.how = key, "in_place"
        else:
            held.how = "held"
        return held
    _SLOTS.pop(slot, None)  # the old model goes before the new one is built
    model, tokenizer = load_checkpoint(path, kind)  # type: ignore[arg-type]
    held = _SLOTS[slot] = Slot(key, arch, kind, model, tokenizer)
    return held


def slot_load(slot: str) -> str | None:
    """How the last `load_model(..., slot=slot)` got its model: 'cache' (the shared cache had
    the checkpoint), 'loaded', 'in_place' or 'held' (the slot); None before any."""
    return _LAST_LOAD.get(slot)


#: Weight files: everything else in a checkpoint directory is part of its architecture.
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")
#: config.json keys that say where and by what it was saved, not what the model is.
_CONFIG_PROVENANCE = ("_name_or_path", "transformers_version")


def architecture(path: Path | str) -> str:
    """Digest of every top-level file of a checkpoint except its weights and manifest (config.json
    without provenance keys): equal digests, a model (or vLLM engine) built from one checkpoint
    takes the other's weights unchanged. Conservative on purpose: a changed tokenizer, chat
    template or generation config (its EOS ids) counts as another architecture."""
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if not f.is_file() or f.name == MANIFEST_NAME or f.name.endswith(_WEIGHT_SUFFIXES):
            continue
        data = f.read_bytes()
        if f.name == "config.json":
            config = json.loads(data)
            for k in _CONFIG_PROVENANCE:
                config.pop(k, None)
            data = json.dumps(config, sort_keys=True).encode()
        h.update(f.name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


def copy_weights(model: Any, path: Path) -> None:
    """Copy the weights of checkpoint `path` (its *.safetensors files) into `model`, whose
    architecture is the checkpoint's: every tensor of the model is overwritten (parameters tied
    to one saved tensor, e.g. an LM head tied to the embeddings, through that tensor), cast to
    the model's dtype as loading would."""
    import torch
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights to load in place")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    result = model.load_state_dict(state, strict=False)
    tied = {name for name in result.missing_keys if _tied(model, name)}
    if result.unexpected_keys or set(result.missing_keys) - tied:
        raise ValueError(f"{path}: its weights do not fit the loaded model (missing "
                         f"{sorted(set(result.missing_keys) - tied)[:5]}, unexpected {result.unexpected_keys[:5]})")


def _tied(model: Any, name: str) -> bool:
    """Whether parameter `name` shares its storage with another parameter (a tied weight,
    saved once under the other name)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    p = params.get(name)
    return p is not None and any(q is p for n, q in params.items() if n != name)


#: Whether a stage keeps the checkpoints it saves in this process's cache, for the next stage of
#: the local runner to read from memory. A resident worker serves one stage: no later stage in its
#: process reads them, and each kept copy would hold a whole model (`keep_saved_checkpoints`).
_KEEP_SAVED = [True]


def keep_saved_checkpoints(enabled: bool) -> None:
    _KEEP_SAVED[0] = enabled


def keeps_saved_checkpoints() -> bool:
    return _KEEP_SAVED[0]


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
    """Drop every cached model and every slot."""
    _CACHE.clear()
    _SLOTS.clear()
    _LAST_LOAD.clear()
