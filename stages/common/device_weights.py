"""The weight channel's same-GPU path: a checkpoint's weight files handed over on the GPU itself.

Resident rollout and optimize members often take the same GPU by turns (one GPU, or a node's GPUs
shared: `launch.share_gpus`). Through shared memory (shared_weights.py) the new policy then goes
GPU -> host -> shared file -> host -> GPU: on an H200 the resident rollout of a 1B policy took
1.07 s against 0.22 s for the rollout that takes it in one process (docs/cluster.md#gpu). Here
the sender packs each weight file's bytes (safetensors header, then every tensor's bytes as they
lie) into one buffer on its GPU, a device-to-device copy made before its next step can change a
parameter, and exports it as a CUDA IPC handle (`torch.multiprocessing.reductions.reduce_tensor`,
the mechanism verl and SkyRL use when trainer and engine share a GPU). A member on that GPU opens
the handle and copies the weights into its model: the bytes never leave the GPU.

- Which GPU: the handle names the sender's device by its index in the sender's numbering; a member
  whose process sees the GPUs in another order (another CUDA_VISIBLE_DEVICES) opens it on its own
  index of the same physical GPU, found by UUID. Each member says at the join, and again after
  each receive, which GPUs it uses (`visible`, once it has started CUDA itself: a vLLM member's
  own process keeps off the GPU, its engine's processes hold it); the sender uses this path only
  when every member uses its GPU.
- What is checked: each file's size against the manifest. Its hash is not recomputed on the member
  (that would be the round trip through host memory this path avoids): the buffer is the sender's
  own copy of the very tensors whose host snapshot it hashed and writes, taken on the same stream
  before either could change, and never written again.
- Lifetime: the sender keeps its buffers until its next send; PyTorch's IPC reference counting
  keeps the memory alive while a member still maps it (the producer frees it at
  `torch.cuda.ipc_collect`, `release`). A member keeps only its newest delivery and lets the one
  before go when the next arrives; the sender collects at its next order's start. So one packed
  copy of the model stays on the GPU while optimize trains (two from a send until then).
- Where it cannot be used (no GPU, a member on another GPU or machine, not enough GPU memory for
  the packed copy) the bytes go through shared memory or the broadcast as before.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlpipe.stages.common.weight_file import WeightFile


def visible() -> list[str]:
    """The UUIDs of the GPUs this process sees, in its own numbering (none without CUDA, or where
    CUDA fails to start: the weights then come through host memory)."""
    try:
        if not torch.cuda.is_available():
            return []
        return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    except RuntimeError:
        return []


def uuid_of(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def on_gpu(tensors: Sequence[torch.Tensor]) -> torch.device | None:
    """The GPU every tensor of `tensors` is on, if they are all on one."""
    devices = {t.device for t in tensors}
    device = next(iter(devices)) if len(devices) == 1 else None
    return device if device is not None and device.type == "cuda" else None


def pack(file: WeightFile, device: torch.device) -> torch.Tensor | None:
    """A safetensors file's bytes (its header, then each tensor's bytes) as one uint8 buffer on
    `device`, the copies enqueued on its current stream; None when the GPU has no room for it."""
    try:
        buffer = torch.empty(len(file), dtype=torch.uint8, device=device)
    except torch.cuda.OutOfMemoryError:
        return None
    buffer[:len(file.header)].copy_(torch.frombuffer(bytearray(file.header), dtype=torch.uint8))
    offset = len(file.header)
    for data in file.tensor_bytes():
        buffer[offset:offset + data.numel()].copy_(data)
        offset += data.numel()
    return buffer


def offer(files: Mapping[str, WeightFile],
          members: Sequence[Sequence[str]]) -> tuple[list[torch.Tensor], dict[str, dict[str, Any]]] | None:
    """The sender's half: weight files (their tensors on a GPU) packed on that GPU and exported
    (the buffers, to keep until the next send; a handle per file), when every member sees that
    GPU (`members`: each member's `visible`); None where this path cannot be taken (tensors not on
    one GPU, a member elsewhere, no room)."""
    devices = {on_gpu(file.tensors) for file in files.values()}
    device = devices.pop() if len(devices) == 1 else None
    if not files or device is None or not members or not all(uuid_of(device) in seen for seen in members):
        return None
    buffers = {}
    for name, file in files.items():
        if (buffer := pack(file, device)) is None:
            return None
        buffers[name] = buffer
    torch.cuda.current_stream(device).synchronize()  # (the members read them from other processes)
    return list(buffers.values()), {name: export(buffer) for name, buffer in buffers.items()}


def export(buffer: torch.Tensor) -> dict[str, Any]:
    """A handle to 1-D uint8 `buffer` another process of this machine can open (`open_handle`),
    as JSON: CUDA's IPC handles of its allocation, its reference counter and its event, and where
    in them the buffer lies. The copies into it must be complete first (the caller synchronises
    the stream: a member's process does not wait on this process's stream)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    (_, _, _, offset, _, _, _, handle, storage_bytes, storage_offset, _,
     counter, counter_offset, event, event_sync) = args
    return {"gpu": uuid_of(buffer.device), "handle": _text(handle),
            "storage_bytes": storage_bytes, "storage_offset": storage_offset, "offset": offset,
            "size": buffer.numel(), "counter": _text(counter), "counter_offset": counter_offset,
            "event": _text(event), "event_sync": event_sync}


def open_handle(handle: dict[str, Any]) -> torch.Tensor:
    """The buffer behind `handle` (`export`), mapped into this process on its own index of the
    sender's GPU; raises ValueError when this process does not see that GPU."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    seen = visible()
    if handle["gpu"] not in seen:
        raise ValueError(f"this process does not see the sender's GPU {handle['gpu']}")
    # (rebuilt as `reduce_tensor`'s counterpart does, on this process's index of the same GPU)
    try:
        return rebuild_cuda_tensor(
            torch.Tensor, (handle["size"],), (1,), handle["offset"], torch.storage.TypedStorage, torch.uint8,
            seen.index(handle["gpu"]), _bytes(handle["handle"]), handle["storage_bytes"], handle["storage_offset"],
            False, _bytes(handle["counter"]), handle["counter_offset"], _bytes(handle["event"]), handle["event_sync"])
    except RuntimeError as e:  # (a CUDA error opening it: another container's GPU, no IPC allowed)
        raise ValueError(f"the sender's GPU buffer could not be opened ({(str(e).splitlines() or [''])[0][:200]})") from e


def _text(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def release() -> None:
    """Free the buffers this process exported that no member holds any more."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()
