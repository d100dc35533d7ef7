"""ZeRO-3's new policy handed over by every rank: each gathers, hashes, sends and writes its own files.

Under ZeRO-3 no rank holds the model: each holds 1/W of every parameter. Gathered to rank 0
(`deepspeed.full_parameters`), rank 0 holds the whole model in host memory (a 70B bf16 policy:
140 GB) and hashes, sends and writes all of it alone while the other ranks wait. Here the
checkpoint's weight files are shared out among the ranks instead:

- the files' layout (each safetensors file's header and its tensors' names) is learnt from the
  first checkpoint a process saves through transformers, with the model gathered to rank 0 as
  before (handoff.SavedForm), and given to every rank (`FilePlan`); every later save uses it while
  the module, its tokenizer, the shard size, its tensors' names, dtypes and shapes and its configs
  are the ones it was learnt from;
- each weight file gets an owner rank (`FilePlan.owners`: the largest file first, to the least
  loaded rank), and each parameter is gathered to the owner of its file alone
  (`deepspeed.gathered_to_owners`); an owner builds its files' bytes (the header, then its
  tensors: `WeightFile`, no joined copy) and hashes them;
- rank 0 writes the small files (config, tokenizer), gathers every weight file's size and hash and
  decides the manifest, which every rank learns;
- every rank sends its own files over the weight channel (weight_channel.py: a group per sender);
- each owner writes its files into the checkpoint's shared staging folder in the background, each
  under a temporary name renamed once complete and synced; rank 0's writer waits for every file,
  then writes the manifest (last) and swaps the folder into place.

So no process holds more than its files (about 1/W of the model) and one module's gather, and the
W ranks hash, send and write in parallel. Killed before the manifest is written, the run reruns
optimize, which makes the same bytes: every later artifact is a cache hit or recomputed identically.
"""

from __future__ import annotations

import json
import os
import time
import weakref
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlpipe.schemas import Manifest
from rlpipe.schemas import pending as pending_artifacts
from rlpipe.schemas.atomic import TMP_SUFFIX
from rlpipe.schemas.errors import ArtifactError
from rlpipe.schemas.manifest import FileInfo
from rlpipe.schemas.staging import (
    open_staging,
    raise_staging_failure,
    staging_path,
    swap_into_place,
)
from rlpipe.schemas.writer import checkpoint_manifest, write_manifest
from rlpipe.stages.common.background import in_background, wait_for_background
from rlpipe.stages.common.weight_file import WeightFile

#: Seconds a rank waits for the staging folder rank 0 made to be visible to it.
STAGING_VISIBLE_S = 60.0
#: Seconds rank 0's writer waits for another rank's next weight file before it gives up (that
#: rank failed: the job fails with it, and the policy is rewritten by the rerun).
FILES_STALL_S = 900.0


@dataclass(frozen=True)
class FilePlan:
    """What every rank knows of a checkpoint's files: learnt from one saved through transformers."""

    layout: tuple
    """Each parameter's and buffer's name, dtype and (whole, not partitioned) shape."""
    configs: tuple[str, str]
    max_shard_size: int | str
    small: dict[str, bytes]
    """Every file but the weight files, as written."""
    weights: dict[str, tuple[bytes, list[str]]]
    """Weight file -> (its safetensors header, the state-dict name of each tensor, in file order)."""

    def owners(self, world: int) -> dict[str, int]:
        """Weight file -> the rank that gathers, hashes, sends and writes it: the largest file
        first, each to the rank with the fewest bytes so far (the lowest of equals)."""
        load, owners = [0] * world, {}
        sizes = {name: _file_size(header) for name, (header, _) in self.weights.items()}
        for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
            rank = min(range(world), key=lambda r: (load[r], r))
            owners[name], load[rank] = rank, load[rank] + sizes[name]
        return owners


def _file_size(header: bytes) -> int:
    """The size of the safetensors file `header` begins: the header, then the data it lays out."""
    n = int.from_bytes(header[:8], "little")
    spans = [info["data_offsets"][1] for name, info in json.loads(header[8:8 + n]).items() if name != "__metadata__"]
    return len(header) + max(spans, default=0)


def _layout(module: Any) -> tuple:
    """`module`'s tensors as a plan knows them: ZeRO-3's parameters by their whole shape."""
    params = [(n, str(p.dtype), tuple(getattr(p, "ds_shape", p.shape))) for n, p in module.named_parameters()]
    return (*params, *((n, str(b.dtype), tuple(b.shape)) for n, b in module.named_buffers()))


def _configs(module: Any) -> tuple[str, str]:
    generation = getattr(module, "generation_config", None)
    return module.config.to_json_string(), generation.to_json_string() if generation is not None else ""


#: The plan of the partitioned module this process last handed over: (module, tokenizer, plan),
#: the first two as weak references (a plan never keeps a model alive).
_PLAN: list[tuple[Any, Any, FilePlan]] = []


def plan_for(module: Any, tokenizer: Any, max_shard_size: int | str) -> FilePlan | None:
    """The plan learnt for `module` (ZeRO-3-partitioned) and `tokenizer`, if it still fits them."""
    if not _PLAN:
        return None
    known, tokenizer_ref, plan = _PLAN[0]
    fits = (known() is module and tokenizer_ref() is tokenizer and plan.max_shard_size == max_shard_size
            and plan.layout == _layout(module) and plan.configs == _configs(module))
    return plan if fits else None


def learn_plan(module: Any, tokenizer: Any, max_shard_size: int | str, form: Any) -> None:
    """Every rank learns the plan of rank 0's `form` (handoff.SavedForm of the checkpoint it just
    saved of `module` gathered; None on the other ranks, or where it made none). Collective."""
    shared = [None if form is None else (form.small, form.weights)]
    torch.distributed.broadcast_object_list(shared, src=0)
    _PLAN.clear()
    if shared[0] is not None:
        small, weights = shared[0]
        plan = FilePlan(_layout(module), _configs(module), max_shard_size, small, weights)
        _PLAN.append((weakref.ref(module), weakref.ref(tokenizer), plan))


def hand_over(module: Any, plan: FilePlan, out: Path, *, manifest_fields: Mapping[str, Any],
              send: Callable[..., bool] | None = None, write_weights: bool = True) -> Manifest:
    """Save ZeRO-3-partitioned `module` as checkpoint `out` by `plan`, each rank its own files (see
    the module doc); returns the manifest (decided now, on every rank). Collective: every rank.

    Args:
        manifest_fields: `checkpoint_manifest`'s keyword arguments (stage, config, inputs, ...).
        send: the weight channel's `send` (every rank's): given this rank's files (rank 0's with
            the small files), the manifest and `senders`; True on every rank or on none.
        write_weights: as handoff.hand_over's: False, the weight files are hashed but not written
            (`Manifest.not_written`) unless the send failed.
    """
    from rlpipe.stages.common.deepspeed import gathered_to_owners

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    staging = staging_path(out, shared=True)
    _agreed(lambda: open_staging(out, shared=True), rank)  # (before any rank writes into it)
    owners = plan.owners(world)
    tensors = gathered_to_owners(module, {name: owners[file] for file, (_, names) in plan.weights.items()
                                          for name in names})
    files = {file: WeightFile(header, [tensors[n] for n in names])
             for file, (header, names) in plan.weights.items() if owners[file] == rank}
    infos = {file: FileInfo.of(file, len(data), data.digest()) for file, data in files.items()}
    everyone: list[dict[str, FileInfo] | None] = [None] * world
    torch.distributed.all_gather_object(everyone, infos)
    known = {name: info for part in everyone for name, info in part.items()}

    def decide() -> str:
        for name, data in plan.small.items():
            (staging / name).write_bytes(data)
        return checkpoint_manifest(staging, known=known, **manifest_fields).model_dump_json()

    manifest = Manifest.model_validate_json(_agreed(decide, rank))
    if send is not None:
        pieces = {name: list(data.pieces()) for name, data in files.items()}
        if rank == 0:
            pieces.update(plan.small)
        sent = send(out, manifest, pieces, senders=world)
        write_weights = write_weights or not sent  # (a member may read the files)
    if not write_weights:  # (the same files and content hash; only the record says what is on disk)
        manifest, files = manifest.model_copy(update={"not_written": sorted(known)}), {}
    if rank == 0:
        pending_artifacts.register(out, manifest, wait=wait_for_background)
        expected = {name: info.bytes for name, info in known.items()} if write_weights else {}
        in_background(lambda: _commit(staging, out, files, expected, manifest), str(out), detached=True)
    else:
        pending_artifacts.register_elsewhere(out, manifest)
        in_background(lambda: _write_files(staging, files), str(out), detached=True)
    return manifest


def _agreed(decide: Callable[[], Any], rank: int) -> Any:
    """What rank 0's `decide()` returns, on every rank; where it raises, every rank raises (rank 0
    its own error, the others a RuntimeError naming it), so no rank waits for a collective rank 0
    never joins."""
    result: list[Any] = [None]
    error: BaseException | None = None
    if rank == 0:
        try:
            result = [("ok", decide())]
        except Exception as e:  # noqa: BLE001 (raised below, after the other ranks know)
            error, result = e, [("error", f"{type(e).__name__}: {e}")]
    torch.distributed.broadcast_object_list(result, src=0)
    if error is not None:
        raise error
    how, value = result[0]
    if how == "error":
        raise RuntimeError(f"optimize rank 0 could not save the policy ({value})")
    return value


def _write_files(staging: Path, files: dict[str, WeightFile]) -> None:
    """This rank's weight files into `staging`, each complete and synced under its own name (rank
    0's writer waits for exactly that)."""
    deadline = time.monotonic() + STAGING_VISIBLE_S
    while files and not staging.is_dir():  # (rank 0 made it; a network file system may show it late)
        if time.monotonic() > deadline:
            raise ArtifactError(f"{staging}: optimize rank 0's staging folder is not visible on this rank after "
                                f"{STAGING_VISIBLE_S:.0f} s; a ZeRO-3 policy is written by every rank, so the run "
                                "folder must be on a file system every node shares (as the train state's is)")
        time.sleep(0.1)
    for name in list(files):
        part = staging / f"{name}{TMP_SUFFIX}"
        with open(part, "wb") as f:
            for piece in files.pop(name).pieces():  # (each file's bytes let go once written)
                f.write(piece)
            f.flush()
            os.fsync(f.fileno())
        os.rename(part, staging / name)


def _commit(staging: Path, out: Path, files: dict[str, WeightFile], expected: Mapping[str, int],
            manifest: Manifest) -> None:
    """Rank 0's background half: its own weight files, then, once every rank's are there
    (`expected`: name -> size), the manifest (last) and the swap."""
    try:
        _write_files(staging, files)
        _wait_for_files(staging, expected)
        write_manifest(staging, manifest)
        swap_into_place(staging, out)
    except BaseException as e:
        raise_staging_failure(e, staging, out)
    finally:
        pending_artifacts.settled(out)


def _wait_for_files(staging: Path, expected: Mapping[str, int]) -> None:
    waiting, progress = dict(expected), time.monotonic()
    while waiting:
        for name, size in list(waiting.items()):
            with suppress(OSError):
                if (staging / name).stat().st_size == size:
                    del waiting[name]
                    progress = time.monotonic()
        if waiting and time.monotonic() - progress > FILES_STALL_S:
            raise TimeoutError(f"{staging}: no other rank's weight file arrived in {FILES_STALL_S:.0f} s "
                               f"(still missing {sorted(waiting)[:3]}); that rank failed")
        if waiting:
            time.sleep(0.01)
