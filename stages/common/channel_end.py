"""A process's end of the weight channel (weight_channel.py): what a resident worker holds and
what its current order takes from it.

Process-wide state: one `WeightChannel` per process, `CHANNEL`, set up by the resident worker from
its group's record and each order (cluster/worker.py), read by optimize (does this order send?)
and by the model loader (was this checkpoint delivered?), reset by `CHANNEL.reset()` (with every
other process-wide object: `process_state.reset_process_state()`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from rlpipe.schemas.errors import ArtifactError
from rlpipe.schemas.manifest import Manifest
from rlpipe.schemas.pending import register_elsewhere, wait_for_manifest
from rlpipe.schemas.reading import read_manifest
from rlpipe.stages.common import device_weights
from rlpipe.stages.common.weight_channel import CONNECT_TIMEOUT_S, Buffer, Sender
from rlpipe.stages.common.weight_delivery import Delivery
from rlpipe.stages.common.weight_file import WeightFile
from rlpipe.stages.common.weight_receiver import Receiver

_log = logging.getLogger(__name__)


class WeightChannel:
    """This process's end of the channel, if it has one (process-wide state: see the module doc).

    A resident optimize member (rank 0) holds a `Sender` and, during an order that sends, the
    receiving group it sends to; a resident rollout member holds a `Receiver` and the deliveries
    its current order takes from it."""

    def __init__(self) -> None:
        self.sender: Sender | None = None
        self.receiver: Receiver | None = None
        self.sending_to: tuple[int, str] | None = None
        """(members, group folder name) of the receiving group, during an order that sends."""
        self.taken: dict[Path, Delivery] = {}
        """The deliveries the current order takes its checkpoints from (path -> delivery)."""

    def receive(self, folder: Path, group: str, member: int) -> None:
        """Start receiving (a rollout member, at its start)."""
        self.receiver = Receiver(folder, group, member).start()

    def order_sends_to(self, folder: Path | None, receivers: tuple[int, str] | None, rank: int) -> None:
        """The order about to run sends its new policy to `receivers` (members, group name), whose
        channel address is kept in `folder` (None: it sends nothing). Every rank of the sending
        job knows it (they take the same path through the save) and holds a `Sender`: rank 0
        sends, and under ZeRO-3 every rank sends its own files (partitioned_handoff.py)."""
        self.sending_to = receivers
        if receivers is not None and folder is not None and (
                self.sender is None or self.sender.receivers != receivers[0] or self.sender.rank != rank):
            if self.sender is not None:
                self.sender.close()
            self.sender = Sender(folder, receivers[0], rank=rank)
        if self.sender is not None and self.sender.device_buffers:
            # (a previous policy handed over on the GPU that the members have let go of since, as
            # they took a newer one, is freed before this order trains: device_weights.py)
            device_weights.release()
        if self.sender is not None and receivers is not None:
            self.sender.prepare()  # (the next hand-off's shared-memory file, allocated while this order trains)

    def sends(self) -> bool:
        """Whether the current order's new policy goes over the channel (on every rank)."""
        return self.sending_to is not None

    def send(self, policy: Path, manifest: Manifest, files: Mapping[str, Buffer | Sequence[Buffer]],
             on_gpu: Mapping[str, WeightFile] | None = None, senders: int = 1) -> bool:
        assert self.sender is not None and self.sending_to is not None
        return self.sender.send(policy, manifest, files, self.sending_to[1], on_gpu, senders)

    def take(self, checkpoints: list[Path], *, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """Before an order: each of `checkpoints` (the order's checkpoint inputs) that was sent
        over the channel is taken from memory: registered as pending (its manifest known, its
        files waited for by whoever reads them) and kept for `delivery`. One that was sent but is
        not here (the channel broke) is read from its file: one log line says so."""
        self.taken = {}
        if self.receiver is None:
            return
        for path in checkpoints:
            path = Path(path).absolute()
            delivery = self.receiver.take(path, timeout_s)
            if delivery is not None:
                self.taken[path] = delivery
                register_elsewhere(path, delivery.manifest)
            elif _sent_by_optimize(path):
                _log.info(f"[rlpipe weight channel] {path} did not come over the weight channel: reading its file")
                # (optimize may still be writing it in the background: a large policy takes a
                # while; a writer that hangs is the driver's stall timeout's to catch)
                wait_for_manifest(path)

    def delivery(self, path: Path | str) -> Delivery | None:
        return self.taken.get(Path(path).absolute())

    def reset(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.stop()
        self.sender = self.receiver = self.sending_to = None
        self.taken = {}


def _sent_by_optimize(path: Path) -> bool:
    """Whether checkpoint `path` is a policy optimize wrote (one a channel would have sent)."""
    try:
        return read_manifest(path).stage == "optimize"
    except ArtifactError:
        return True  # (not on disk yet: it can only be on its way)


CHANNEL = WeightChannel()
