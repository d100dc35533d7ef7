"""A safetensors file held in memory as its header and its tensors: what the hand-off hashes and
writes (handoff.py) and the weight channel sends (weight_channel.py, device_weights.py), one
definition for all of them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rlpipe.schemas.hashing import new_hasher


@dataclass
class WeightFile:
    """A safetensors file held as its header and its tensors, in file order: the bytes it is
    (`pieces`), hashed and written without joining them into one buffer. The format: an 8-byte
    little-endian header length n, n bytes of JSON header (name -> dtype, shape, [begin, end) in
    the data), then the data: every tensor's bytes, back to back."""

    header: bytes
    tensors: list[torch.Tensor]
    origins: list[torch.Tensor] | None = None
    """The module's tensors the `tensors` were copied from (on a GPU: what the weight channel hands
    over there, device_weights.py); None when they are the tensors themselves."""

    def pieces(self) -> Iterator[memoryview]:
        yield memoryview(self.header)
        for data in self.tensor_bytes():
            yield memoryview(data.numpy())

    def tensor_bytes(self) -> Iterator[torch.Tensor]:
        """Each non-empty tensor's bytes, in file order: a uint8 view on its device."""
        for t in self.tensors:
            if t.numel():
                yield t.detach().reshape(-1).view(torch.uint8)

    def __len__(self) -> int:
        return len(self.header) + sum(t.numel() * t.element_size() for t in self.tensors)

    def digest(self) -> str:
        h = new_hasher()
        for piece in self.pieces():
            h.update(piece)
        return h.hexdigest()

    def to_bytes(self) -> bytes:
        return b"".join(self.pieces())
