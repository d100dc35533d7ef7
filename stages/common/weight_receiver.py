"""The weight channel's receiving end (weight_channel.py): a rollout member's thread that joins
each generation of the channel and keeps the newest policy it received, checked against its
manifest."""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from rlpipe.schemas.manifest import MANIFEST_NAME, Manifest
from rlpipe.stages.common import device_weights, shared_weights, weight_channel
from rlpipe.stages.common.weight_channel import CONNECT_TIMEOUT_S, Address, broadcast_plan
from rlpipe.stages.common.weight_delivery import Delivery, check_delivery

_log = logging.getLogger(__name__)

#: How long one wait for the next header lasts (`_poll`).
_HEADER_WAIT = timedelta(hours=1)


class Receiver:
    """A rollout member's end: a thread joining each generation and keeping what it receives."""

    def __init__(self, folder: Path, group: str, member: int, *, timeout_s: float = CONNECT_TIMEOUT_S):
        self.folder, self.group, self.member, self.timeout_s = Path(folder), group, member, timeout_s
        self._lock = threading.Condition()
        self._deliveries: dict[Path, Delivery] = {}
        self._receiving: Path | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="rlpipe-weight-channel", daemon=True)

    def start(self) -> Receiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()

    def _run(self) -> None:
        joined = 0
        while not self._stop:
            address = Address.read(self.folder)
            if address is None or address.generation <= joined or address.group != self.group:
                time.sleep(0.05)
                continue
            joined = address.generation
            try:
                store = torch.distributed.TCPStore(address.host, address.port, address.receivers + address.senders,
                                                   is_master=False, timeout=timedelta(seconds=self.timeout_s))
                local = shared_weights.sees(address.probe, address.nonce)
                store.set(f"weights/{joined}/local/{self.member}", "1" if local else "0")
                self._say_gpus(store, joined, local)
                # one group per sender (sender r, then the members): each sends its own files
                groups = [weight_channel.new_group(address.backend,
                                                   torch.distributed.PrefixStore(f"weights/{joined}/from/{r}", store),
                                                   self.member + 1, address.receivers + 1, self.timeout_s)
                          for r in range(address.senders)]
            except Exception as e:  # noqa: BLE001 (a generation this member could not join: wait for the next)
                _log.warning(f"[rlpipe weight channel] member {self.member} could not join generation {joined} "
                             f"({type(e).__name__}); it reads the policy files until the next")
                continue
            try:
                received = 0
                while not self._stop:
                    header = _poll(store, f"weights/{joined}/header/{received + 1}", lambda: self._stop)
                    if header is None:
                        break
                    received += 1
                    self._receive(groups, json.loads(header), store)
                    self._say_gpus(store, joined, local)  # (a member may have started CUDA since)
            except Exception as e:  # noqa: BLE001 (the sender gone, a timeout between sends: wait for a new generation)
                with self._lock:
                    self._receiving = None
                    self._lock.notify_all()
                _log.info(f"[rlpipe weight channel] member {self.member}: generation {joined} ended "
                          f"({type(e).__name__}); waiting for the next")

    def _say_gpus(self, store: Any, generation: int, local: bool) -> None:
        """Which GPUs this member uses, for the sender (device_weights.py): those it sees, once
        it has started CUDA itself (a vLLM member's engine runs in processes of its own: its
        own process keeps off the GPU), on the sender's machine only."""
        gpus = device_weights.visible() if local and torch.cuda.is_initialized() else []
        store.set(f"weights/{generation}/gpus/{self.member}", json.dumps(gpus))

    def _receive(self, groups: list[Any], header: dict[str, Any], store: Any) -> None:
        policy = Path(header["policy"])
        with self._lock:
            self._receiving = policy
        manifest = Manifest.model_validate_json(header["manifest"])
        parts = [header, *(json.loads(store.get(key)) for key in header.get("parts", []))]
        try:
            files = receive_files(groups, parts)
        except (OSError, ValueError) as e:  # (a shared file gone or cut, a GPU buffer not opened: this generation goes on)
            files, problem = {}, f"unreadable ({type(e).__name__}: {e})"
        else:
            problem = check_delivery(manifest, files)
        for part in parts:
            if part.get("shared") and store.add(part["mapped"], 1) == header["receivers"]:
                shared_weights.remove(part["shared"])  # (every member has it mapped: the mappings outlive it)
        with self._lock:
            self._receiving = None
            if problem is None:
                # only the newest policy is kept: a rollout samples from the latest it was sent
                self._deliveries = {policy: Delivery(policy, manifest, files)}
            else:
                _log.warning(f"[rlpipe weight channel] member {self.member}: {policy} arrived {problem}; "
                             "the file is read instead")
            self._lock.notify_all()

    def take(self, policy: Path | str, timeout_s: float) -> Delivery | None:
        """The delivery of checkpoint `policy`: at once when received, after waiting while it is
        being received, else (none in flight for it, or `timeout_s` passed) None."""
        policy = Path(policy).absolute()
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while policy not in self._deliveries and time.monotonic() < deadline:
                if self._receiving is not None and self._receiving != policy:
                    break
                if self._receiving is None and (policy / MANIFEST_NAME).is_file():
                    break  # (its file is complete and nothing is on its way: read the file)
                self._lock.wait(0.05)
            return self._deliveries.get(policy)


def receive_files(groups: list[Any], parts: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """A member's half of one hand-off: each sender's part (rank 0's, the header, first), from its
    group: each file the part lists, mapped from the shared-memory file it names, or into a buffer
    of its size in the sender's broadcasts (`broadcast_plan`), and each weight file handed over on
    the GPU (`device`), opened there (device_weights.py)."""
    files: dict[str, torch.Tensor] = {}
    for group, part in zip(groups, parts, strict=True):
        files.update(_received_bytes(group, part, parts[0]["bucket"]))
    files.update({name: device_weights.open_handle(handle) for name, handle in parts[0].get("device", {}).items()})
    return files


def _received_bytes(group: Any, part: dict[str, Any], bucket: int) -> dict[str, torch.Tensor]:
    if part.get("shared"):
        return shared_weights.read(part["shared"], part["files"])
    files = {}
    for name, pieces in part["files"]:
        files[name] = data = torch.empty(sum(pieces), dtype=torch.uint8)
        offset = 0
        for spans in broadcast_plan(pieces, bucket):
            size = sum(end - begin for _, begin, end in spans)
            weight_channel.broadcast(group, data[offset:offset + size])
            offset += size
    return files


def _poll(store: Any, key: str, stopped: Any) -> str | None:
    """The value of `key` once the sender sets it (None if the receiver stops first); raises when
    the store is gone (the sender's process ended: a new generation will come). A blocking wait on
    the store, so the member joins the broadcast as soon as the header is set: in waits of an hour
    (torch's store logs two warning lines for every wait that times out, which a wait of a second
    put in the member's log every second of an iteration); a receiver stopped meanwhile takes
    nothing that comes after."""
    while not stopped():
        try:
            store.wait([key], _HEADER_WAIT)
        except torch.distributed.DistStoreError as e:
            if "timeout" not in str(e).lower():
                raise
            continue
        return None if stopped() else store.get(key).decode()
    return None
