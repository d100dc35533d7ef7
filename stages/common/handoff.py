"""The new policy handed to the next stage in memory; its checkpoint written in the background.

In one process (the local runner) the rollout after optimize k samples from the model optimize
just trained. Writing that model to disk and hashing it, then reading and hashing it back, is a
round trip the next stage does not need: it takes a plain copy of the weights from memory (the
model cache of `models.py`), while the checkpoint is written by a background thread as the record
(stages/common/background.py). The checkpoint stays the contract:

- its manifest is decided before the write starts: the weight files' bytes are serialised in
  memory first (the very bytes `save_pretrained` writes: `transformers` builds them and this
  module takes them instead of letting it write them), hashed there, and the small files
  (config, generation config, tokenizer) are written and hashed at once. So the next stage's
  manifest and cache key name the checkpoint's content hash exactly as if it had read the file;
- until the manifest is on disk this process knows the checkpoint as pending (schemas/pending.py):
  whoever reads its files waits for them; other processes see nothing;
- killed before the manifest is written, the run reruns optimize (its output is missing) and
  gets the same bytes, so every later artifact is a cache hit or recomputed to the same content.

Only the plain causal policy of a one-process run is handed over this way (a LoRA policy's merged
weights, a critic, a checkpoint of several ranks are saved as before).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from rlpipe.schemas import Manifest
from rlpipe.schemas import pending as pending_artifacts
from rlpipe.schemas.hashing import digest_bytes
from rlpipe.schemas.manifest import FileInfo
from rlpipe.schemas.staging import open_staging, raise_staging_failure, swap_into_place
from rlpipe.schemas.writer import checkpoint_manifest, write_manifest
from rlpipe.stages.common.background import in_background, wait_for_background


def host_copy(module: Any, dtype: torch.dtype = torch.float32) -> Any:
    """A plain copy of a Hugging Face `module` on the CPU in `dtype` (eval mode, no DeepSpeed hooks),
    equal to what loading its saved checkpoint in `dtype` gives: built without initialising weights
    that are overwritten at once, parameters tied in `module` (an LM head and the embeddings) tied
    in the copy."""
    from transformers.initialization import no_init_weights

    copies: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict().items():
        # one copy per distinct tensor: tied parameters share a storage (and offset, shape)
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if ident not in copies:
            copies[ident] = tensor.detach().to(device="cpu", dtype=dtype, copy=True)
        state[name] = copies[ident]
    with no_init_weights():
        copy = type(module)(module.config)
    copy.load_state_dict(state, assign=True)
    if hasattr(copy, "tie_weights"):  # (a transformers model; assigning may untie two tied parameters)
        copy.tie_weights()
    if module.can_generate():
        copy.generation_config = module.generation_config
    return copy.eval()


@contextlib.contextmanager
def weights_in_memory() -> Iterator[dict[str, bytes]]:
    """Within the block, `save_pretrained` (safetensors) writes every file but its weight files,
    whose bytes go into the yielded dict (file name -> bytes) instead. (It swaps transformers'
    module-level writer for the block: only the calling thread saves Hugging Face checkpoints
    meanwhile; the background writers write bytes or DeepSpeed states, never through it.)"""
    from safetensors.torch import save
    from transformers import modeling_utils

    captured: dict[str, bytes] = {}

    def keep(tensors: dict[str, torch.Tensor], filename: str, metadata: dict[str, str] | None = None) -> None:
        captured[os.path.basename(filename)] = save(tensors, metadata=metadata)

    original = modeling_utils.safe_save_file
    modeling_utils.safe_save_file = keep
    try:
        yield captured
    finally:
        modeling_utils.safe_save_file = original


def hand_over(module: Any, tokenizer: Any, out: Path, *, max_shard_size: int | str,
              manifest_fields: Mapping[str, Any], copy: bool = True,
              send: Callable[[Path, Manifest, dict[str, bytes]], bool] | None = None) -> tuple[Manifest, Any]:
    """Save `module` + `tokenizer` as the checkpoint `out` in the background; returns its manifest
    (decided now) and, with `copy`, a host copy of the model for the next stage in this process
    (see the module doc).

    Args:
        manifest_fields: `checkpoint_manifest`'s keyword arguments (stage, config, inputs, ...).
        send: given every file's bytes (and the manifest) before the write starts: the weight
            channel to the resident rollout members (weight_channel.py), which reads nothing of
            the disk. Its failure is its own to report: the file is written either way.
    """
    from rlpipe.stages.common.tiny import save_pretrained

    staging = open_staging(out)
    try:
        with weights_in_memory() as weights:
            save_pretrained(module, tokenizer, staging, max_shard_size=max_shard_size)
        known = {name: FileInfo.of(name, len(data), digest_bytes(data)) for name, data in weights.items()}
        manifest = checkpoint_manifest(staging, known=known, **manifest_fields)
    except BaseException as e:
        raise_staging_failure(e, staging, out)
    if send is not None:
        small = {f.name: f.read_bytes() for f in staging.iterdir() if f.is_file()}
        send(out, manifest, {**weights, **small})
    copy = host_copy(module) if copy else None
    pending_artifacts.register(out, manifest, wait=wait_for_background)
    in_background(lambda: _write(staging, out, weights, manifest), str(out))
    return manifest, copy


def _write(staging: Path, out: Path, weights: dict[str, bytes], manifest: Manifest) -> None:
    """The background half: the weight files, then the manifest (last), then the swap."""
    try:
        for name in list(weights):
            with open(staging / name, "wb") as f:
                f.write(weights.pop(name))  # (each file's bytes freed once written)
                f.flush()
                os.fsync(f.fileno())
        write_manifest(staging, manifest)
        swap_into_place(staging, out)
    except BaseException as e:
        raise_staging_failure(e, staging, out)
    finally:
        pending_artifacts.settled(out)
