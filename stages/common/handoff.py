"""The new policy handed to the next stage in memory; its checkpoint written in the background.

In one process (the local runner) the rollout after optimize k samples from the model optimize
just trained. Writing that model to disk and hashing it, then reading and hashing it back, is a
round trip the next stage does not need: it takes a plain copy of the weights from memory (the
model cache of `models.py`), while the checkpoint is written by a background thread as the record
(stages/common/background.py). The checkpoint stays the contract:

- its manifest is decided before the write starts: the tensors `save_pretrained` would write are
  snapshotted to host memory (`transformers` decides which, under which names; this module takes
  them instead of letting it write them), hashed there as the very bytes of their safetensors
  files (header, then each tensor's bytes: `WeightFile`, no joined copy), and the small files
  (config, generation config, tokenizer) are written and hashed at once. So the next stage's
  manifest and cache key name the checkpoint's content hash exactly as if it had read the file.
  The copy handed over is made on the module's device (a GPU's policy does not leave it), and on
  the CPU shares the snapshots (an fp32 policy is copied once, not twice); without a
  copy (a resident optimize sending over the weight channel) the files are written and sent from
  the module's own tensors, which its next run waits for before its first step (`stable`);
- until the manifest is on disk this process knows the checkpoint as pending (schemas/pending.py):
  whoever reads its files waits for them; other processes see nothing;
- killed before the manifest is written, the run reruns optimize (its output is missing) and
  gets the same bytes, so every later artifact is a cache hit or recomputed to the same content.

Only the plain causal policy of a one-process run is handed over this way (a LoRA policy's merged
weights, a critic, a checkpoint of several ranks are saved as before).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlpipe.schemas import Manifest
from rlpipe.schemas import pending as pending_artifacts
from rlpipe.schemas.manifest import FileInfo
from rlpipe.schemas.staging import open_staging, raise_staging_failure, swap_into_place
from rlpipe.schemas.writer import checkpoint_manifest, write_manifest
from rlpipe.stages.common import device_weights
from rlpipe.stages.common.background import in_background, wait_for_background
from rlpipe.stages.common.weight_file import WeightFile


def model_copy(module: Any, dtype: torch.dtype = torch.float32,
               taken: Mapping[tuple, torch.Tensor] | None = None) -> Any:
    """A plain copy of a Hugging Face `module` in `dtype` on the module's device (eval mode, no
    DeepSpeed hooks), equal to what loading its saved checkpoint in `dtype` gives: built without
    initialising weights that are overwritten at once, parameters tied in `module` (an LM head and
    the embeddings) tied in the copy. On a GPU the copy stays there: the next stage of this process
    samples on that GPU, and a round trip through host memory (down in bf16, up in fp32) cost 1.3 s
    of a 1B policy's 2.9 s iteration on an H200 (docs/cluster.md#gpu). `taken`: copies already made
    of some of its tensors (`tensor_identity` -> copy, the snapshots `weights_in_memory` took), used
    as they are where their dtype and device are the copy's."""
    copies: dict[tuple, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    device = next(module.parameters()).device
    for name, tensor in module.state_dict().items():
        # one copy per distinct tensor: tied parameters share a storage (and offset, shape)
        ident = tensor_identity(tensor)
        if ident not in copies:
            snapshot = (taken or {}).get(ident)
            copies[ident] = (snapshot if snapshot is not None and snapshot.dtype == dtype
                             and snapshot.device == tensor.device
                             else tensor.detach().to(dtype=dtype, copy=True))
        state[name] = copies[ident]
    copy = rebuilt(module, state)
    # (built on the CPU, its parameters assigned: the buffers its constructor computed, rotary
    # frequencies say, follow the parameters' device; the parameters are not copied again)
    return copy.to(device) if device.type != "cpu" else copy


def rebuilt(module: Any, state: Mapping[str, torch.Tensor]) -> Any:
    """A new model of `module`'s class and config holding the tensors `state` (its state dict's
    names) as they are, in eval mode: built without initialising weights that are overwritten at
    once; parameters tied in `module` tied again."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        copy = type(module)(module.config)
    copy.load_state_dict(state, assign=True)
    if hasattr(copy, "tie_weights"):  # (a transformers model; assigning may untie two tied parameters)
        copy.tie_weights()
    if module.can_generate():
        copy.generation_config = module.generation_config
    return copy.eval()


def tensor_identity(tensor: torch.Tensor) -> tuple:
    """Which memory a tensor is: equal for two views of the same elements (tied parameters)."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)


#: A file layout (each tensor's name, dtype and shape; the metadata) -> (its safetensors header, the
#: tensor names in file order). The header depends on nothing else, so a policy saved every
#: iteration is serialised by safetensors once, then hashed and written straight from its tensors.
_LAYOUTS: dict[tuple, tuple[bytes, list[str]]] = {}
_MAX_LAYOUTS = 16


def _layout_key(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> tuple:
    return (tuple(sorted((n, str(t.dtype), tuple(t.shape)) for n, t in tensors.items())),
            tuple(sorted((metadata or {}).items())))


def _layout(data: bytes, tensors: Mapping[str, torch.Tensor]) -> tuple[bytes, list[str]] | None:
    """(header, names in file order) of safetensors bytes `data` of `tensors`, when `data` is
    exactly that header followed by the tensors' bytes back to back (checked); else None."""
    n = int.from_bytes(data[:8], "little")
    spans = sorted((info["data_offsets"], name) for name, info in json.loads(data[8:8 + n]).items()
                   if name != "__metadata__")
    header, order = data[:8 + n], [name for _, name in spans]
    laid = WeightFile(header, [tensors[name] for name in order]) if set(order) == set(tensors) else None
    return (header, order) if laid is not None and laid.to_bytes() == data else None


@contextlib.contextmanager
def weights_in_memory(snapshot: bool = True) -> Iterator[tuple[dict[str, WeightFile], dict[tuple, torch.Tensor],
                                                                   dict[str, list[tuple]]]]:
    """Within the block, `save_pretrained` (safetensors) writes every file but its weight files,
    which go into the first yielded dict (file name -> WeightFile) instead: each tensor behind its
    header, with `snapshot` a copy on the CPU (also in the second dict, by the saved tensor's
    `tensor_identity`), else the tensor itself where it is on the CPU (see `hand_over`'s `stable`).
    The third dict: each weight file's saved tensors' `tensor_identity`, in file order (`SavedForm`).
    (It swaps transformers' module-level writer for the block: only the calling thread saves
    Hugging Face checkpoints meanwhile; the background writers write bytes or DeepSpeed states,
    never through it.)"""
    from safetensors.torch import save
    from transformers import modeling_utils

    captured: dict[str, WeightFile] = {}
    taken: dict[tuple, torch.Tensor] = {}
    sources: dict[str, list[tuple]] = {}  # file -> the `tensor_identity` of each tensor saved, in file order

    def keep(tensors: dict[str, torch.Tensor], filename: str, metadata: dict[str, str] | None = None) -> None:
        held = _arrived({name: _held(t, snapshot, taken) for name, t in tensors.items()})
        key = _layout_key(held, metadata)
        if key not in _LAYOUTS:  # the first file of this layout: safetensors lays it out
            data = save(held, metadata=metadata)
            layout = _layout(data, held)
            if layout is None:  # (not laid out as expected: kept as safetensors wrote it)
                captured[os.path.basename(filename)] = WeightFile(data, [])
                return
            if len(_LAYOUTS) >= _MAX_LAYOUTS:
                _LAYOUTS.pop(next(iter(_LAYOUTS)))
            _LAYOUTS[key] = layout
        header, order = _LAYOUTS[key]
        captured[os.path.basename(filename)] = WeightFile(header, [held[name] for name in order],
                                                          [tensors[name] for name in order])
        sources[os.path.basename(filename)] = [tensor_identity(tensors[name]) for name in order]

    original = modeling_utils.safe_save_file
    modeling_utils.safe_save_file = keep
    try:
        yield captured, taken, sources
    finally:
        modeling_utils.safe_save_file = original


def _held(t: torch.Tensor, snapshot: bool, taken: dict[tuple, torch.Tensor]) -> torch.Tensor:
    """What a weight file holds of tensor `t`: a copy on the CPU (also put in `taken`, by `t`'s
    identity) with `snapshot` or off the CPU, else `t` itself (made contiguous). From a GPU the
    copy goes into page-locked memory without waiting (`_arrived` waits for all of them at once):
    the GPU copies into it directly (pageable memory goes through a staging buffer, one piece at a
    time), and PyTorch's pinned-memory cache hands the blocks of the previous snapshot (let go
    once written) to the next one."""
    if not snapshot and t.device.type == "cpu":
        return t.detach().contiguous()
    if t.device.type == "cuda":
        copy = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        copy.copy_(t.detach(), non_blocking=True)
    else:
        copy = t.detach().to(device="cpu", copy=True).contiguous()
    taken[tensor_identity(t)] = copy
    return copy


def _arrived(tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """`tensors` once the copies `_held` started from a GPU have landed (read no byte before)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
    return tensors


@dataclass
class SavedForm:
    """What `save_pretrained` wrote for a module and tokenizer, kept to write the same files again
    from the module's tensors without it: the module's every save (once an iteration) otherwise
    pays transformers' whole save path (unwrapping, weight-conversion checks, shard planning,
    config, generation config and tokenizer files: 2.7 ms at 1M parameters here, more with more
    tensors) for bytes that differ only in the weights. Used only while the module, its tokenizer,
    the shard size, every state-dict tensor's name, dtype and shape and both configs are the ones
    it was made from, and only when every saved tensor is one of the module's own (not one
    transformers built while saving)."""

    module: Any  # (weak references: a form never keeps a model alive)
    tokenizer: Any
    max_shard_size: int | str
    layout: tuple
    configs: tuple[str, str]
    small: dict[str, bytes]
    """Every file but the weight files, as written."""
    weights: dict[str, tuple[bytes, list[str]]]
    """Weight file -> (its safetensors header, the state-dict name of each tensor, in file order)."""

    def fits(self, module: Any, tokenizer: Any, max_shard_size: int | str) -> bool:
        return (self.module() is module and self.tokenizer() is tokenizer and self.max_shard_size == max_shard_size
                and self.layout == _state_layout(module) and self.configs == _configs(module))

    def write(self, module: Any, staging: Path, snapshot: bool) -> tuple[dict[str, WeightFile], dict[tuple, torch.Tensor]]:
        """The small files written into `staging`; the weight files (and the copies taken) as
        `weights_in_memory` gives them."""
        for name, data in self.small.items():
            (staging / name).write_bytes(data)
        state, taken = module.state_dict(), {}
        held = _arrived({name: _held(state[name], snapshot, taken) for _, names in self.weights.values()
                         for name in names})
        weights = {file: WeightFile(header, [held[name] for name in names], [state[name] for name in names])
                   for file, (header, names) in self.weights.items()}
        return weights, taken


def _state_layout(module: Any) -> tuple:
    return tuple((name, t.dtype, tuple(t.shape)) for name, t in module.state_dict().items())


def _configs(module: Any) -> tuple[str, str]:
    generation = getattr(module, "generation_config", None)
    return module.config.to_json_string(), generation.to_json_string() if generation is not None else ""


def saved_form(module: Any, tokenizer: Any, max_shard_size: int | str, staging: Path,
               weights: Mapping[str, WeightFile], sources: Mapping[str, list[tuple]]) -> SavedForm | None:
    """The form of what `save_pretrained` just wrote into `staging` (`weights` and their `sources`
    from `weights_in_memory`), or None when a saved tensor is not one of the module's own."""
    import weakref

    names = {tensor_identity(t): name for name, t in module.state_dict().items()}
    if set(weights) != set(sources) or any(ident not in names for idents in sources.values() for ident in idents):
        return None
    return SavedForm(weakref.ref(module), weakref.ref(tokenizer), max_shard_size, _state_layout(module),
                     _configs(module), {f.name: f.read_bytes() for f in staging.iterdir() if f.is_file()},
                     {file: (weights[file].header, [names[i] for i in sources[file]]) for file in weights})


#: The form of the last checkpoint `hand_over` saved through transformers (one: a run hands over
#: one policy at a time).
_FORM: list[SavedForm] = []


def last_form() -> SavedForm | None:
    """The form of the last checkpoint `hand_over` saved through transformers, if it made one."""
    return _FORM[0] if _FORM else None


def hand_over(module: Any, tokenizer: Any, out: Path, *, max_shard_size: int | str,
              manifest_fields: Mapping[str, Any], copy: bool = True, stable: bool = False,
              send: Callable[[Path, Manifest, dict[str, Any], dict[str, Any]], bool] | None = None,
              copy_dtype: torch.dtype = torch.float32, write_weights: bool = True,
              disposable: bool = False) -> tuple[Manifest, Any]:
    """Save `module` + `tokenizer` as the checkpoint `out` in the background; returns its manifest
    (decided now) and, with `copy`, a copy of the model (on its device, in `copy_dtype`: what the
    next stage computes in) for the next stage in this process (see the module doc).

    Args:
        manifest_fields: `checkpoint_manifest`'s keyword arguments (stage, config, inputs, ...).
        stable: `module`'s tensors stay as they are until this process's background work is
            waited for (optimize's next run waits for it before its first step; ZeRO-3's gathered
            parameters do not: they go when the gather ends). Without a copy for the next stage,
            the files are then written (and sent) from them: no snapshot of the whole model.
        send: given every file's bytes (a weight file's as its pieces: `WeightFile.pieces`) and
            the manifest before the write starts, and the weight files whose tensors are on a GPU
            (as `WeightFile`s of those tensors): the weight channel to the resident rollout members
            (weight_channel.py), which reads nothing of the disk. Its failure is its own to report:
            the file is written either way.
        write_weights: False: the weight files are hashed (the manifest is the same) but never
            written (`Manifest.not_written`): the policy between two train-state saves with
            `optimize.policy_weights: with_train_state`, which only the copy or the channel
            carries on. Where `send` fails they are written after all (a member may read them).
        disposable: `module` is a copy made for this hand-over (ZeRO-3's, gathered module by
            module onto the GPU the next stage samples on): the copy handed over takes its tensors
            where their dtype is the copy's, instead of copying them once more.
    """
    from rlpipe.stages.common.tiny import save_pretrained

    staging = open_staging(out)
    snapshot = copy or not stable
    try:
        if _FORM and _FORM[0].fits(module, tokenizer, max_shard_size):
            weights, taken = _FORM[0].write(module, staging, snapshot)
        else:
            with weights_in_memory(snapshot=snapshot) as (weights, taken, sources):
                save_pretrained(module, tokenizer, staging, max_shard_size=max_shard_size)
            _FORM[:] = [f for f in [saved_form(module, tokenizer, max_shard_size, staging, weights, sources)] if f]
        known = {name: FileInfo.of(name, len(file), file.digest()) for name, file in weights.items()}
        manifest = checkpoint_manifest(staging, known=known, **manifest_fields)
    except BaseException as e:
        raise_staging_failure(e, staging, out)
    if send is not None:
        small = {f.name: f.read_bytes() for f in staging.iterdir() if f.is_file()}
        on_gpu = {name: WeightFile(file.header, file.origins) for name, file in weights.items()
                  if file.origins and device_weights.on_gpu(file.origins) is not None}
        sent = send(out, manifest, {**{name: list(file.pieces()) for name, file in weights.items()}, **small}, on_gpu)
        write_weights = write_weights or not sent
    for file in weights.values():
        file.origins = None  # (the background write needs only the host copies)
    if not write_weights:  # (the same files and content hash; only the record says what is on disk)
        manifest, weights = manifest.model_copy(update={"not_written": sorted(known)}), {}
    if copy:
        own = {tensor_identity(t): t for t in module.state_dict().values()} if disposable else {}
        copy = model_copy(module, copy_dtype, taken={**taken, **own})
    else:
        copy = None
    pending_artifacts.register(out, manifest, wait=wait_for_background)
    # (detached where the files are written from snapshots: optimize's next step may change the module meanwhile)
    in_background(lambda: _write(staging, out, weights, manifest), str(out), detached=snapshot)
    return manifest, copy


def weight_files(module: Any, tokenizer: Any, max_shard_size: int | str) -> dict[str, FileInfo]:
    """The manifest entries of the weight files `hand_over` would write for `module` (the same
    bytes), hashed in memory: nothing is written. What a checkpoint whose weights were never
    written (`Manifest.not_written`) is checked against."""
    import tempfile

    from rlpipe.stages.common.tiny import save_pretrained

    with tempfile.TemporaryDirectory() as scratch, weights_in_memory(snapshot=False) as (weights, _, _):
        save_pretrained(module, tokenizer, scratch, max_shard_size=max_shard_size)
    return {name: FileInfo.of(name, len(file), file.digest()) for name, file in weights.items()}


def _write(staging: Path, out: Path, weights: dict[str, WeightFile], manifest: Manifest) -> None:
    """The background half: the weight files, then the manifest (last), then the swap."""
    try:
        for name in list(weights):
            with open(staging / name, "wb") as f:
                for piece in weights.pop(name).pieces():  # (each file's snapshot let go once written)
                    f.write(piece)
                f.flush()
                os.fsync(f.fileno())
        write_manifest(staging, manifest)
        swap_into_place(staging, out)
    except BaseException as e:
        raise_staging_failure(e, staging, out)
    finally:
        pending_artifacts.settled(out)
