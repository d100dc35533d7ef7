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

Process-wide state: one object per process, `MODELS` (a `ModelMemory`), owned by this module: the
cache, the slots, how each slot's last load went and whether stages keep the checkpoints they save
(`keep_saved_checkpoints`). `clear_cache()` drops every model and tokenizer (a process that wants its
memory back); `MODELS.reset()` also restores the default setting, as in a fresh process. Tests reset it
with every other process-wide object through `process_state.reset_process_state()`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlpipe.schemas.errors import ArtifactError
from rlpipe.schemas.manifest import MANIFEST_NAME, Manifest
from rlpipe.schemas.verify import verify_checkpoint
from rlpipe.stages.common.model_loading import current

#: How many models the shared cache holds at most (the oldest goes first).
_MAX_ENTRIES = 4


@dataclass
class Slot:
    """A stage's own model: which checkpoint (content key) and architecture it holds."""

    key: str
    architecture: str
    kind: str
    model: Any
    tokenizer: Any
    loading: Any = None
    """The `model_loading` setting it was built under (another one builds it again)."""
    dtype: Any = None
    """The torch dtype it computes in (another one builds it again)."""
    how: str = "loaded"
    """How the last `load_model` into the slot got its weights: 'loaded' (built from the
    checkpoint), 'in_place' (copied into the slot's model), 'held' (it held them already),
    'channel' (copied into the slot's model from the weight channel's delivery)."""


class ModelMemory:
    """The models this process keeps between loads and stages (see the module doc)."""

    def __init__(self) -> None:
        self.cache: dict[tuple[str, str, Any, Any], tuple[Any, Any]] = {}
        """(checkpoint content key, kind, model_loading setting, dtype) -> (model, tokenizer):
        shared, read-only models, at most `_MAX_ENTRIES` (the oldest dropped first)."""
        self.slots: dict[str, Slot] = {}
        """Slot name -> what it holds (see the module doc)."""
        self.tokenizers: dict[str, Any] = {}
        """`architecture` digest -> the tokenizer of checkpoints of that architecture
        (`shared_tokenizer`): shared and read-only, at most `_MAX_ENTRIES`."""
        self.last_load: dict[str, str] = {}
        """Slot name -> how its caller's last load got the model ('cache' or a `Slot.how`)."""
        self.keep_saved = True
        """Whether a stage keeps the checkpoints it saves in the cache, for the next stage of the
        local runner to read from memory. A resident worker serves one stage: no later stage in its
        process reads them, and each kept copy would hold a whole model (`keep_saved_checkpoints`)."""

    def reset(self) -> None:
        """Drop every model and slot, and keep saved checkpoints again: a fresh process."""
        clear_cache()
        self.keep_saved = True


#: This process's models (see the module doc).
MODELS = ModelMemory()


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
               slot: str | None = None, dtype: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer) from a Hugging Face directory in `dtype` (None: fp32), eval mode.

    Args:
        kind: 'causal', or 'reward' / 'critic' (a `ScalarHeadModel`: backbone + one output per
            position; see scalar_head.py).
        dtype: a torch dtype (`model_loading.compute_dtype`); models of two dtypes are two
            models (cached and held apart).
        cache: reuse/keep the loaded model in the in-process cache.
        slot: on a cache miss, load into this slot of the caller's (see the module doc) instead
            of the cache.
    """
    import torch

    from rlpipe.schemas.pending import pending_manifest
    from rlpipe.stages.common.tiny import load_checkpoint

    path, dtype = Path(path), dtype or torch.float32
    if slot is not None and (delivered := _from_channel(slot, path, kind, dtype)) is not None:
        return delivered.model, delivered.tokenizer
    if cache and pending_manifest(path) is not None and _cache_key(path, kind, dtype) in MODELS.cache:
        # the policy optimize just handed over in memory, its files still being written (handoff.py)
        if slot is not None:
            MODELS.last_load[slot] = "cache"
        return MODELS.cache[_cache_key(path, kind, dtype)]
    if not path.is_dir() and pending_manifest(path) is None:
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    manifest = verify_checkpoint(path)  # every file as its manifest promises (hashes memoised by stat); waits for a pending write
    key = _cache_key(path, kind, dtype) if cache else None
    if key not in MODELS.cache:  # (read from its files)
        _refuse_unwritten(path, manifest)
    if not cache:
        return load_checkpoint(path, kind, dtype)  # type: ignore[arg-type]
    if slot is not None:
        if key in MODELS.cache:  # (the local runner: the checkpoint optimize just saved, from memory)
            MODELS.last_load[slot] = "cache"
            return MODELS.cache[key]
        held = load_into_slot(slot, path, kind, key[0], dtype)
        MODELS.last_load[slot] = held.how
        return held.model, held.tokenizer
    if key not in MODELS.cache:
        if len(MODELS.cache) >= _MAX_ENTRIES:
            MODELS.cache.pop(next(iter(MODELS.cache)))
        MODELS.cache[key] = load_checkpoint(path, kind, dtype)  # type: ignore[arg-type]
    return MODELS.cache[key]


def _refuse_unwritten(path: Path, manifest: Manifest | None) -> None:
    """A checkpoint whose weights were never written (`Manifest.not_written`) cannot be loaded
    from its files: say which, why, and what to do."""
    if manifest is not None and manifest.not_written:
        raise ArtifactError(
            f"{path}: its weights ({', '.join(manifest.not_written)}) were never written: with "
            "optimize.policy_weights: with_train_state only the iterations that save the train state, the "
            "last one and those that evaluate write them, and this process does not hold them in memory. "
            "Load the policy of such an iteration, or rerun the run (`rlpipe run`), which recomputes it; set "
            "optimize.policy_weights: every_iteration to write every policy")


def load_into_slot(slot: str, path: Path, kind: str, key: str, dtype: Any) -> Slot:
    """The slot holding checkpoint `path` (content `key`) in `dtype`: as it is, with the weights
    copied in place (same architecture, kind and dtype), or with a newly loaded model."""
    from rlpipe.stages.common.tiny import load_checkpoint

    slots = MODELS.slots
    held, arch = slots.get(slot), architecture(path)
    # (weights in place only from safetensors: other formats go through the full load, which
    # refuses pickled ones naming the file)
    in_place = any(Path(path).glob("*.safetensors"))
    if (held is not None and held.kind == kind and held.architecture == arch and in_place
            and held.loading == current() and held.dtype == dtype):
        if held.key != key:
            copy_weights(held.model, path)
            held.key, held.how = key, "in_place"
        else:
            held.how = "held"
        return held
    slots.pop(slot, None)  # the old model goes before the new one is built
    model, tokenizer = load_checkpoint(path, kind, dtype)  # type: ignore[arg-type]
    held = slots[slot] = Slot(key, arch, kind, model, tokenizer, current(), dtype)
    return held


def _from_channel(slot: str, path: Path, kind: str, dtype: Any) -> Slot | None:
    """The slot with checkpoint `path` copied in from the weight channel's delivery of it (a
    resident rollout member: weight_channel.py), when there is one and the slot holds a model of
    its architecture; else None (the checkpoint is read from its files)."""
    from rlpipe.stages.common.channel_end import CHANNEL

    delivery = CHANNEL.delivery(path)
    held = MODELS.slots.get(slot)
    if delivery is None or held is None or held.kind != kind or held.dtype != dtype:
        return None
    if held.architecture != architecture_of(delivery.small_files()):
        return None
    if held.key != delivery.manifest.content_hash:
        copy_state(held.model, delivery.tensors(), f"{path} (from the weight channel)")
        held.key = delivery.manifest.content_hash
    held.how = MODELS.last_load[slot] = "channel"
    return held


def shared_tokenizer(path: Path | str) -> Any:
    """The tokenizer of checkpoint `path` (`load_tokenizer`), built once per architecture in this
    process (a policy saved every iteration keeps its tokenizer files): read-only, like the cached
    models. Building one costs ~5 ms for a tiny tokenizer, 0.1-1 s for a real model's."""
    from rlpipe.schemas.pending import wait_until_written
    from rlpipe.stages.common.tiny import load_tokenizer

    # (a checkpoint still written in the background, here or by another rank: its files first)
    wait_until_written(path)
    key = f"{architecture(path)} trust_remote_code={current().trust_remote_code}"
    if key not in MODELS.tokenizers:
        if len(MODELS.tokenizers) >= _MAX_ENTRIES:
            MODELS.tokenizers.pop(next(iter(MODELS.tokenizers)))
        MODELS.tokenizers[key] = load_tokenizer(path)
    return MODELS.tokenizers[key]


def slot_load(slot: str) -> str | None:
    """How the last `load_model(..., slot=slot)` got its model: 'cache' (the shared cache had
    the checkpoint), 'loaded', 'in_place', 'held' or 'channel' (the slot); None before any."""
    return MODELS.last_load.get(slot)


#: Weight files: everything else in a checkpoint directory is part of its architecture.
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")
#: Keys that say where and by what a file was saved, not what the model is: config.json's, and
#: tokenizer_config.json's (transformers 5 adds how the tokenizer was last loaded: the base model's
#: tokenizer, re-saved by optimize, would otherwise be another architecture than the policies').
_PROVENANCE = {"config.json": ("_name_or_path", "transformers_version"),
               "tokenizer_config.json": ("is_local", "local_files_only", "_commit_hash")}


def architecture(path: Path | str) -> str:
    """Digest of every top-level file of a checkpoint except its weights and manifest (config.json
    and tokenizer_config.json without provenance keys): equal digests, a model (or vLLM engine) built from one checkpoint
    takes the other's weights unchanged. Conservative on purpose: a changed tokenizer, chat
    template or generation config (its EOS ids) counts as another architecture."""
    return architecture_of({f.name: f.read_bytes() for f in Path(path).iterdir()
                            if f.is_file() and f.name != MANIFEST_NAME and not f.name.endswith(_WEIGHT_SUFFIXES)})


def architecture_of(files: Mapping[str, bytes]) -> str:
    """`architecture` of a checkpoint whose top-level files (name -> bytes) are in memory."""
    h = hashlib.sha256()
    for name, data in sorted(files.items()):
        if name == MANIFEST_NAME or name.endswith(_WEIGHT_SUFFIXES):
            continue
        if name in _PROVENANCE:
            config = json.loads(data)
            for k in _PROVENANCE[name]:
                config.pop(k, None)
            data = json.dumps(config, sort_keys=True).encode()
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


def checkpoint_tensors(path: Path | str) -> Iterator[tuple[str, Any]]:
    """The (name, tensor) pairs of checkpoint `path`'s weights (its *.safetensors files, in file
    name order: sharded ones too), read one tensor at a time onto the CPU as saved: what an
    in-place load copies into a model of the checkpoint's architecture (`copy_weights`, vLLM's
    workers). FileNotFoundError (on the first pair) when it has no safetensors weights."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights to load in place")
    for f in files:  # one tensor at a time: a caller that streams them holds no second whole model
        with safe_open(f, framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def copy_weights(model: Any, path: Path) -> None:
    """Copy the weights of checkpoint `path` (its *.safetensors files) into `model`, whose
    architecture is the checkpoint's: every tensor of the model is overwritten (parameters tied
    to one saved tensor, e.g. an LM head tied to the embeddings, through that tensor), cast to
    the model's dtype as loading would."""
    copy_state(model, dict(checkpoint_tensors(path)), str(path))


def copy_state(model: Any, state: Mapping[str, Any], source: str) -> None:
    """Copy the saved tensors `state` (name -> tensor, as in the checkpoint `source`) into `model`
    (see `copy_weights`)."""
    result = model.load_state_dict(state, strict=False)
    tied = {name for name in result.missing_keys if _tied(model, name)}
    if result.unexpected_keys or set(result.missing_keys) - tied:
        raise ValueError(f"{source}: its weights do not fit the loaded model (missing "
                         f"{sorted(set(result.missing_keys) - tied)[:5]}, unexpected {result.unexpected_keys[:5]})")


def _tied(model: Any, name: str) -> bool:
    """Whether parameter `name` shares its storage with another parameter (a tied weight,
    saved once under the other name)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    p = params.get(name)
    return p is not None and any(q is p for n, q in params.items() if n != name)


def keep_saved_checkpoints(enabled: bool) -> None:
    """Whether stages keep the checkpoints they save in this process's cache (`ModelMemory.keep_saved`)."""
    MODELS.keep_saved = enabled


def keeps_saved_checkpoints() -> bool:
    return MODELS.keep_saved


def remember(path: Path | str, kind: str, model: Any, tokenizer: Any) -> None:
    """Record an in-memory model as the content of checkpoint `path` (just saved from it), in the
    dtype it computes in."""
    cache = MODELS.cache
    if len(cache) >= _MAX_ENTRIES:
        cache.pop(next(iter(cache)))
    cache[_cache_key(path, kind, next(model.parameters()).dtype)] = (model, tokenizer)


def holds(content_hash: str) -> bool:
    """Whether this process holds the weights of the checkpoint with `content_hash` (cached or in a slot)."""
    return (any(key[0] == content_hash for key in MODELS.cache)
            or any(held.key == content_hash for held in MODELS.slots.values()))


def _cache_key(path: Path | str, kind: str, dtype: Any) -> tuple[str, str, Any, Any]:
    """A cached model's key: its checkpoint's content, its kind, how it was loaded, its dtype."""
    return checkpoint_key(path), kind, current(), dtype


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
    """Drop every cached model and every slot (the `keep_saved_checkpoints` setting stays)."""
    MODELS.cache.clear()
    MODELS.tokenizers.clear()
    MODELS.slots.clear()
    MODELS.last_load.clear()
