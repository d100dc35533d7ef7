"""The new policy sent from the optimize group to the rollout members over torch.distributed.

With resident worker groups (`launch.resident`) optimize and rollout are separate processes, and
the policy optimize k trains is what rollout k+1 samples from. Through the file system that is a
write, an fsync, a read and a hash on the critical path of every iteration (a 1B bf16 policy: 2 GB
each way). Here the optimize member sends the checkpoint's files straight from memory to every
rollout member, while it writes the same bytes to disk in the background as the record:

    optimize rank 0 --(header: policy path, manifest; then each file in buckets)--> rollout members
    optimize rank r --(ZeRO-3: its own files, in a group of its own)---------------> rollout members

- The channel is a process group made for it, apart from the optimize job's own (gloo, over TCP,
  from host memory; NCCL between GPU members is not built yet; members on the sender's own GPU
  take the weight files there instead: device_weights.py). Optimize's rank 0 hosts its
  rendezvous (a TCPStore on a free port) and writes the address to `<workers>/weight-channel.json`;
  each rollout member joins from a receiving thread. Under ZeRO-3 on several ranks every rank
  sends the weight files it owns (partitioned_handoff.py): the address says how many senders,
  sender r and the members make group r, rank 0's header names the store key of each other
  sender's part (its files' sizes), and a member receives the parts in rank order. A channel
  that breaks (a member killed, a timeout) is abandoned; the sender opens a new generation (a new
  address) at its next send and the members that are alive join it.
- Members on the sender's machine (all of a generation's: tried with a probe at the join) get
  the bytes through one file in shared memory instead of the broadcasts, which on one machine still
  cross the loopback's TCP stack (shared_weights.py: one copy instead of a socket's several).
- What is sent are the checkpoint's files themselves (the safetensors bytes `save_pretrained`
  writes, serialised in memory by handoff.py), so the receiver checks every file's size and hash
  against the manifest it was sent: the copy it loads is the checkpoint, bit for bit.
- The receiver registers the delivered manifest as pending (schemas/pending.py): the rollout
  names the policy's content hash as its input, as if it had read the file; a reader of the files
  waits for them on disk. A member that cannot take the policy from the channel (none received
  for it, the channel down, a size or hash mismatch) reads the file and says so in one log line.
- The checkpoint's manifest is still written last by optimize: a run killed before it reruns
  optimize, which makes the same bytes, so every later artifact is a cache hit or recomputed
  identically.

This module is the channel itself and its sending end; the receiving end is weight_receiver.py; a
process's end of it (what a resident worker holds, what its current order takes) is
`channel_end.CHANNEL`.
"""

from __future__ import annotations

import json
import logging
import socket
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from rlpipe.schemas.atomic import atomic_write_json
from rlpipe.schemas.manifest import Manifest
from rlpipe.stages.common import device_weights, shared_weights
from rlpipe.stages.common.weight_file import WeightFile

_log = logging.getLogger(__name__)

#: Bytes as the sender holds them (a file's, or a piece of one).
Buffer = bytes | bytearray | memoryview

#: The channel's address, in the run's workers/ folder: written by the sender, read by members.
ADDRESS_FILE = "weight-channel.json"
#: Bytes per broadcast: large enough that a call's fixed cost is noise, small enough that a
#: receiver's buffer and the sender's view of it never double a large model's memory.
BUCKET_BYTES = 64 << 20
#: Pieces of a file smaller than this are packed into one broadcast (`broadcast_plan`).
PACK_BYTES = 1 << 20
#: Seconds the sender waits for every member to join a new generation, and a member for the
#: sender; a collective that makes no progress for as long fails (and the file is read).
CONNECT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Address:
    """One generation of the channel: where its rendezvous listens and how many join it."""

    generation: int
    host: str
    port: int
    receivers: int
    backend: str
    group: str
    """The receiving group (its folder's name): a group the driver starts anew gets a generation
    of its own, and its members join no generation made for the one before."""
    probe: str | None = None
    """A shared-memory probe file (shared_weights.py): a member that reads back `nonce` from it
    shares the sender's memory."""
    nonce: str | None = None
    senders: int = 1
    """The optimize ranks that send (ZeRO-3's: each its own files, `partitioned_handoff.py`); a
    member joins one group per sender, group `r` being sender r and the members."""

    def write(self, folder: Path) -> None:
        atomic_write_json(folder / ADDRESS_FILE, self.__dict__)

    @classmethod
    def read(cls, folder: Path) -> Address | None:
        try:
            return cls(**json.loads((folder / ADDRESS_FILE).read_text()))
        except (OSError, ValueError, TypeError):
            return None


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    group.broadcast([tensor], opts).wait()


def broadcast_plan(sizes: Sequence[int], bucket: int) -> list[list[tuple[int, int, int]]]:
    """How a file sent as pieces of `sizes` bytes goes: one broadcast per entry, each the spans
    (piece, begin, end) that lie back to back in the file. A piece of PACK_BYTES or more goes on
    its own, in `bucket`-sized parts; smaller ones are packed together up to `bucket` (a model's
    norms and biases: each a round trip of its own otherwise). The receiver, whose copy of the file
    is one buffer, needs only each broadcast's size; both sides derive the plan from the sizes."""
    plan: list[list[tuple[int, int, int]]] = []
    packed: list[tuple[int, int, int]] = []
    filled = 0
    for i, size in enumerate(sizes):
        if size >= PACK_BYTES:
            if packed:
                plan.append(packed)
                packed, filled = [], 0
            plan += [[(i, begin, min(begin + bucket, size))] for begin in range(0, size, bucket)]
        elif size:
            if filled + size > bucket:
                plan.append(packed)
                packed, filled = [], 0
            packed.append((i, 0, size))
            filled += size
    if packed:
        plan.append(packed)
    return plan


def new_group(backend: str, store: Any, rank: int, size: int, timeout_s: float) -> Any:
    # gloo only, for now: the buckets are host memory (the bytes written to disk as well). NCCL
    # between GPU members, the buckets going device to device, is the next step.
    if backend != "gloo":
        raise ValueError(f"weight channel backend {backend!r}: only 'gloo' is built")
    return torch.distributed.ProcessGroupGloo(store, rank, size, timeout=timedelta(seconds=timeout_s))


def this_host() -> str:
    """An address of this machine the members can reach: its host name resolved (127.0.0.1 when
    it does not resolve: members on this machine only)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class Sender:
    """An optimize rank's end. Rank 0 hosts each generation's rendezvous and sends the header (the
    policy, its manifest, its own files); with several senders (ZeRO-3: each rank its own files,
    partitioned_handoff.py) every rank broadcasts its part in a group of its own with the members."""

    def __init__(self, folder: Path, receivers: int, *, rank: int = 0, backend: str = "gloo",
                 timeout_s: float = CONNECT_TIMEOUT_S, host: str | None = None, bucket_bytes: int = BUCKET_BYTES,
                 shared_memory: bool = True):
        self.folder, self.receivers, self.backend, self.rank = Path(folder), receivers, backend, rank
        self.senders = 1  # (this generation's: `send`'s `senders`)
        self.shared_memory = shared_memory  # (offered to the members of this machine: shared_weights.py)
        self.local = False  # whether every member of this generation shares this process's memory
        self.shared_files: list[Path] = []  # hand-offs written to shared memory, not yet let go
        self.spare = shared_weights.Spare()  # the next one's file, allocated beforehand (`prepare`)
        self.shared_size = 0  # bytes of the last hand-off through shared memory
        self.device_buffers: list[torch.Tensor] = []  # weight files handed over on the GPU, not yet let go
        self.timeout_s, self.host, self.bucket_bytes = timeout_s, host, bucket_bytes
        self.group: Any = None
        self.store: Any = None
        self._packing = torch.empty(0, dtype=torch.uint8)  # (`_packed`)
        self.receiving_group = ""  # the receiving group this generation was made for
        self.sent = 0  # hand-offs sent in this generation
        previous = Address.read(self.folder)
        self.generation = previous.generation if previous is not None else 0

    def _open(self, receiving_group: str, senders: int) -> None:
        """A new generation: a rendezvous on a free port (rank 0's), its address published (and
        given to the other senders), every member joined to each sender's group.

        With several senders the optimize ranks take part in one collective here, the address's
        broadcast, whether rank 0 could open the rendezvous or not (then every rank fails this send)."""
        self.close()
        self.sent, self.receiving_group, self.senders = 0, receiving_group, senders
        address, probe, failed = None, None, None
        if self.rank == 0:
            try:
                address, probe = self._rendezvous(receiving_group, senders)
            except Exception as e:  # noqa: BLE001 (raised below, once the other senders know)
                failed = e
        if senders > 1:
            shared = [address]
            torch.distributed.broadcast_object_list(shared, src=0)
            address = shared[0]
        if failed is not None:
            raise failed
        if address is None:
            raise ConnectionError("the channel's rendezvous could not be opened on optimize rank 0")
        self.generation = address.generation
        try:
            if self.rank != 0:
                self.store = torch.distributed.TCPStore(address.host, address.port, self.receivers + senders,
                                                        is_master=False, timeout=timedelta(seconds=self.timeout_s))
                # (before rank 0 removes the probe: it waits for every sender's word)
                sees = shared_weights.sees(address.probe, address.nonce)
                self.store.set(f"weights/{self.generation}/sender-local/{self.rank}", "1" if sees else "0")
            prefixed = torch.distributed.PrefixStore(f"weights/{self.generation}/from/{self.rank}", self.store)
            self.group = new_group(self.backend, prefixed, 0, self.receivers + 1, self.timeout_s)
            # (each member said whether it read the probe before joining a group, each sender on joining)
            self.local = address.probe is not None and all(
                self.store.get(f"weights/{self.generation}/local/{m}") == b"1" for m in range(self.receivers)) and all(
                self.store.get(f"weights/{self.generation}/sender-local/{r}") == b"1" for r in range(1, senders))
        finally:
            shared_weights.remove(probe and probe[0])

    def _rendezvous(self, receiving_group: str, senders: int) -> tuple[Address, tuple[str, str] | None]:
        """Rank 0's half of a new generation: the store on a free port and its address, written."""
        host = self.host or this_host()
        self.store = torch.distributed.TCPStore(host, 0, self.receivers + senders, is_master=True,
                                                timeout=timedelta(seconds=self.timeout_s), wait_for_workers=False)
        probe = None
        if self.shared_memory:
            shared_weights.sweep()
            probe = shared_weights.probe(str(self.generation + 1))
        address = Address(self.generation + 1, host, self.store.port, self.receivers, self.backend, receiving_group,
                          *(probe or (None, None)), senders=senders)
        address.write(self.folder)
        return address, probe

    def send(self, policy: Path, manifest: Manifest, files: Mapping[str, Buffer | Sequence[Buffer]],
             receiving_group: str, on_gpu: Mapping[str, WeightFile] | None = None, senders: int = 1) -> bool:
        """Broadcast checkpoint `policy` (its manifest and every file's bytes: one buffer, or its
        pieces in order, e.g. a safetensors header and then each tensor's bytes, sent as they lie
        without joining them) to every member of `receiving_group`; False (and one log line) when
        the channel fails: the members then read the file. `on_gpu`: the weight files whose
        tensors are on a GPU (`WeightFile`s of those tensors), handed over there when every member shares
        it (device_weights.py) instead of with the other files.

        `senders` > 1: every optimize rank calls it with the files it holds (ZeRO-3's, each rank
        its own: partitioned_handoff.py), rank 0 with the small files too; it returns True on every
        rank or on none (one more collective of the optimize ranks), and `on_gpu` is not taken."""
        started = time.perf_counter()
        pieces = {name: [data] if isinstance(data, bytes | bytearray | memoryview) else list(data)
                  for name, data in files.items()}
        shared, device, sent = None, {}, True
        try:
            if self.group is None or receiving_group != self.receiving_group or senders != self.senders:
                self._open(receiving_group, senders)
            self.sent += 1
            # The previous hand-off's file is mapped by now (a member maps it as the header comes,
            # an iteration ago) or never will be (its member is gone): it goes.
            self._let_go()
            offered = (device_weights.offer(on_gpu, self._member_gpus())
                       if self.local and on_gpu and senders == 1 else None)
            self.device_buffers, device = offered or ([], {})
            pieces = {name: parts for name, parts in pieces.items() if name not in device}
            if self.local:  # (None when it cannot be written: then broadcast)
                size = sum(len(p) for parts in pieces.values() for p in parts)
                shared = shared_weights.write(f"{self.generation}-{self.sent}", pieces, spare=self.spare.take(size))
                self.shared_size = size if shared is not None else 0
            part = {"files": [[name, [len(p) for p in parts]] for name, parts in pieces.items()],
                    "shared": None if shared is None else str(shared),
                    "mapped": f"weights/{self.generation}/mapped/{self.sent}/{self.rank}"}
            # the header (rank 0's part) through the rendezvous store: a member waits for it there
            # between hand-offs (a collective would time out while training runs), then maps the
            # shared file (the last one to map it removes it) or takes part in the broadcasts;
            # then each other sender's part, under the key the header names
            if self.rank == 0:
                self.store.set(f"weights/{self.generation}/header/{self.sent}", json.dumps({
                    "policy": str(Path(policy).absolute()), "manifest": manifest.model_dump_json(), **part,
                    "bucket": self.bucket_bytes, "device": device, "receivers": self.receivers,
                    "parts": [self._part_key(r) for r in range(1, senders)]}))
            else:
                self.store.set(self._part_key(self.rank), json.dumps(part))
            if shared is not None:
                self.shared_files.append(shared)
            else:
                self._broadcast_files(pieces)
        except Exception as e:  # a member gone, a timeout: this generation is over
            _log.warning(f"[rlpipe weight channel] sending {policy} failed ({type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:200]}); the rollout members read its file")
            sent = False
        if senders > 1:  # (every rank sent its part, or the members read the file)
            agreed = torch.tensor([int(sent)])
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
            sent = bool(agreed.item())
        if not sent:
            self.close()
            return False
        size = sum(len(p) for parts in pieces.values() for p in parts) + sum(h["size"] for h in device.values())
        how = ", ".join([*(["on the GPU"] if device else []), *(["shared memory"] if shared else [])])
        whose = f" (rank {self.rank} of {senders})" if senders > 1 else ""
        _log.info(f"[rlpipe weight channel] sent {policy.name}{whose} ({size / 1e6:.1f} MB) to {self.receivers} "
                  f"member(s) in {time.perf_counter() - started:.2f} s{f' ({how})' if how else ''}")
        return True

    def _part_key(self, rank: int) -> str:
        return f"weights/{self.generation}/part/{self.sent}/{rank}"

    def prepare(self) -> None:
        """Allocate the next hand-off's shared-memory file now, off the send's critical path
        (called as an order that sends starts: while it trains), where the last hand-off went
        through shared memory: of its size (`shared_weights.Spare`)."""
        if self.local and self.shared_size:
            self.spare.prepare(self.shared_size)

    def _broadcast_files(self, pieces: Mapping[str, list[Buffer]]) -> None:
        with warnings.catch_warnings():  # (a read-only buffer: broadcast from the root only reads it)
            warnings.simplefilter("ignore", UserWarning)
            for parts in pieces.values():
                views = [torch.frombuffer(p, dtype=torch.uint8) if len(p) else None for p in parts]
                for spans in broadcast_plan([len(p) for p in parts], self.bucket_bytes):
                    broadcast(self.group, self._packed(views, spans))

    def _packed(self, views: list[torch.Tensor | None], spans: list[tuple[int, int, int]]) -> torch.Tensor:
        """One broadcast's bytes: a span of one piece as it lies, or small pieces copied into a
        buffer kept for the next (a bucket at most)."""
        if len(spans) == 1:
            i, begin, end = spans[0]
            return views[i][begin:end]
        size = sum(end - begin for _, begin, end in spans)
        if self._packing.numel() < size:
            self._packing = torch.empty(size, dtype=torch.uint8)
        offset = 0
        for i, begin, end in spans:
            self._packing[offset:offset + end - begin] = views[i][begin:end]
            offset += end - begin
        return self._packing[:size]

    def _member_gpus(self) -> list[list[str]]:
        """The GPUs each member of this generation uses (said at the join, again after each receive)."""
        return [json.loads(self.store.get(f"weights/{self.generation}/gpus/{m}")) for m in range(self.receivers)]

    def _let_go(self) -> None:
        while self.shared_files:
            shared_weights.remove(self.shared_files.pop())
        if self.device_buffers:  # (freed once no member maps them: PyTorch's IPC reference counts)
            self.device_buffers = []
            device_weights.release()

    def close(self) -> None:
        self._let_go()
        self.spare.discard()
        if self.group is not None:
            try:
                self.group.abort()
            except Exception:  # noqa: BLE001 (a broken group may refuse; it is dropped anyway)
                pass
        self.group = self.store = None
        self.local = False
