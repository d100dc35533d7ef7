"""How every stage's run opens: its inputs by content, its cache key, and the cache hit.

Read from the `Input` / `Output` markers of the stage's config, so no stage lists its inputs
again. A stage's `run` is written as its work alone and wrapped by `opens`:

    @opens("advantage")
    def run(config: AdvantageConfig, start: StageStart) -> Manifest:
        ... compute, then write with `inputs=start.inputs, cache_key=start.key`

which gives the stage's `run(config, *, force=False) -> Manifest`: a cache hit returns at once.

Inputs are checked before any work: a table input must be a complete artifact of the schema its
marker names, a checkpoint input a Hugging Face directory (a `UserError` naming the field and path
otherwise). The cache key hashes the stage name, the config without its paths (`cache_dict`) and
the inputs' content hashes, so a moved or copied run directory reruns as cache hits.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rlpipe.schemas import InputRef, Manifest, cache_key, cached_manifest, read_manifest
from rlpipe.schemas.atomic import content_sha256
from rlpipe.schemas.config import StageConfig
from rlpipe.schemas.errors import UserError
from rlpipe.schemas.inputs import input_problem
from rlpipe.schemas.manifest import MANIFEST_NAME
from rlpipe.schemas.reading import recorded_manifest
from rlpipe.stages.common.model_loading import loading


@dataclass(frozen=True)
class StageStart:
    """What a stage knows before it works."""

    inputs: dict[str, InputRef]
    """Each input artifact by field name, with its content hash (recorded in the manifests)."""
    key: str
    """The cache key of this work."""
    cached: Manifest | None
    """The primary output's manifest when every output already holds this work (else None)."""
    force: bool = False
    """Recompute even on a cache hit (passed on to the stages this one runs inside)."""
    outputs_written: frozenset[str] = frozenset()
    """The outputs (field names) already written with this work's cache key, when not all are: a
    run killed after writing some of them (optimize's policy, before its train state). A stage may
    keep them as they are rather than write the same content again (nothing complete is rewritten)."""
    started: float = field(default_factory=time.time)
    """When the stage started (time.time()), for the manifests' wall time."""


def input_refs(config: StageConfig) -> dict[str, InputRef]:
    """Every input the config names, checked and identified by content. A pruned input is
    identified by the content it had (its record): enough for a cache hit, which reads nothing."""
    from rlpipe.schemas.pending import pending_manifest
    from rlpipe.schemas.pruning import pruned
    from rlpipe.stages.common.models import checkpoint_key

    refs: dict[str, InputRef] = {}
    for name, path in config.inputs().items():
        kind = config.input_kind(name)
        record = pruned(path)
        if record is not None:
            refs[name] = record.manifest.as_input(path)
            continue
        decided = pending_manifest(path)  # a checkpoint this process is writing in the background
        if decided is not None:
            refs[name] = decided.as_input(path)
            continue
        if kind == "checkpoint" and (known := _CHECKED.get(_checkpoint_state(path))) is not None:
            refs[name] = InputRef(path=str(path), content_hash=known)
            continue
        problem = input_problem(path, kind)
        if problem:
            raise UserError(f"{name}: {problem}")
        if kind == "checkpoint":
            refs[name] = InputRef(path=str(path), content_hash=checkpoint_key(path))
            if (state := _checkpoint_state(path)) is not None:
                _CHECKED[state] = refs[name].content_hash
                while len(_CHECKED) > _CHECKED_KEPT:
                    del _CHECKED[next(iter(_CHECKED))]
        elif kind == "file":
            refs[name] = InputRef(path=str(path), content_hash=content_sha256(path))
        else:
            refs[name] = read_manifest(path).as_input(path)
    return refs


#: The content hash of each checkpoint with a manifest this process checked (`input_problem`), by its
#: state (`_checkpoint_state`): an optimize run's inputs name every policy since the last train
#: state (`replay`), each checked once rather than on every run (~0.5 ms each).
_CHECKED: dict[tuple, str] = {}
_CHECKED_KEPT = 256


def _checkpoint_state(path: Any) -> tuple | None:
    """A checkpoint folder's state as far as its check goes: its manifest's (inode, size, mtime)
    and the folder's mtime (a file added, removed or renamed in it); None without a manifest (a
    Hugging Face folder: checked every time). File times tick with the kernel's coarse clock (up
    to 10 ms): a change within the tick of the last check goes unseen here, not when the files are
    read (the manifest names every file's hash, which every read verifies)."""
    try:
        manifest, folder = os.stat(os.path.join(path, MANIFEST_NAME)), os.stat(path)
    except OSError:
        return None
    return (os.path.abspath(path), manifest.st_ino, manifest.st_size, manifest.st_mtime_ns, folder.st_mtime_ns)


def begin(stage: str, config: StageConfig, *, force: bool = False,
          extra_inputs: Mapping[str, InputRef] | None = None,
          key_config: Mapping[str, Any] | None = None) -> StageStart:
    """The inputs, key and cache hit of `stage` run with `config`.

    Args:
        extra_inputs: inputs that are not config fields of their own (a reward-model component's
            checkpoint inside the score config).
        key_config: what decides the work when it is not `config.cache_dict()` (e.g. without the
            fields that only split the work between workers).
    """
    inputs = {**input_refs(config), **(extra_inputs or {})}
    decided_by = dict(key_config) if key_config is not None else config.cache_dict()
    key = cache_key(stage, decided_by, {role: ref.content_hash for role, ref in inputs.items()})
    outputs = config.outputs()
    written = frozenset() if force else frozenset(n for n, p in outputs.items() if cached_manifest(p, key) is not None)
    cached = None
    if written == set(outputs):
        cached = recorded_manifest(next(iter(outputs.values())))
    else:
        _refuse_pruned_inputs(config)
    return StageStart(inputs, key, cached, force, outputs_written=written)


def _refuse_pruned_inputs(config: StageConfig) -> None:
    """The stage must work, and an input it would read was pruned: stop now, naming it."""
    from rlpipe.schemas.pruning import pruned, pruned_error

    for name, path in config.inputs().items():
        record = pruned(path)
        if record is not None:
            raise pruned_error(path, record, role=name)


C = TypeVar("C", bound=StageConfig)


def opens(stage: str, *, extra_inputs: Callable[[Any], Mapping[str, InputRef]] | None = None,
          key_config: Callable[[Any], Mapping[str, Any]] | None = None
          ) -> Callable[[Callable[[C, StageStart], Manifest]], Callable[..., Manifest]]:
    """Decorator: the work `body(config, start)` of `stage` becomes its `run(config, *, force=False)`,
    which opens with `begin` (the arguments, given the config, are begin's) and returns a cache hit
    without calling the body; the body runs with the config's `loading` current (model_loading.py)."""
    def wrap(body: Callable[[C, StageStart], Manifest]) -> Callable[..., Manifest]:
        @functools.wraps(body)
        def run(config: C, *, force: bool = False) -> Manifest:
            start = begin(stage, config, force=force,
                          extra_inputs=extra_inputs(config) if extra_inputs else None,
                          key_config=key_config(config) if key_config else None)
            if start.cached is not None:
                return start.cached
            with loading(getattr(config, "loading", None)):  # (how its models load: model_loading.py)
                return body(config, start)
        return run
    return wrap
