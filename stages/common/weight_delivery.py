"""What a rollout member receives over the weight channel (weight_channel.py): a checkpoint's files
as bytes in memory, checked against the manifest sent with them, and its tensors read as views of
those bytes (the safetensors layout), so the copy a member loads is the checkpoint, bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from rlpipe.schemas.hashing import digest_bytes
from rlpipe.schemas.manifest import Manifest


@dataclass
class Delivery:
    """A checkpoint received in full: its manifest and each file's bytes (a uint8 tensor; on a GPU
    for a weight file handed over there: device_weights.py)."""

    policy: Path
    manifest: Manifest
    files: dict[str, torch.Tensor]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of its *.safetensors files, as views of the received bytes (no copy)."""
        out: dict[str, torch.Tensor] = {}
        for name, data in sorted(self.files.items()):
            if name.endswith(".safetensors"):
                out.update(safetensors_views(data))
        return out

    def small_files(self) -> dict[str, bytes]:
        """Every file but the weights (config, generation config, tokenizer), as bytes."""
        return {name: data.numpy().tobytes() for name, data in self.files.items()
                if not name.endswith(".safetensors")}


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def safetensors_views(data: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in memory as a uint8 tensor (on its device), as views of it.

    The format: an 8-byte little-endian header length n, n bytes of JSON header
    (name -> dtype, shape, [begin, end) in the data that follows), then the data."""
    n = int.from_bytes(data[:8].cpu().numpy().tobytes(), "little")
    header = json.loads(data[8:8 + n].cpu().numpy().tobytes())
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        out[name] = data[base + begin:base + end].view(dtype).view(info["shape"])
    return out


def check_delivery(manifest: Manifest, files: Mapping[str, torch.Tensor]) -> str | None:
    """None when every file matches the manifest's size and hash, else what does not."""
    infos = {f.name: f for f in manifest.files}
    for name, data in files.items():
        info = infos.get(name)
        if info is None:
            return f"with a file its manifest does not list ({name})"
        if info.bytes != data.numel():
            return f"with {name} of {data.numel()} bytes, not {info.bytes}"
        if data.device.type == "cuda":
            continue  # (the sender's own copy of the tensors it hashed, never sent through host memory: device_weights.py)
        if digest_bytes(memoryview(data.numpy()), info.algorithm) != info.digest:
            return f"with {name} not matching its hash"
    missing = set(infos) - set(files)
    return f"without {sorted(missing)[0]}" if missing else None
