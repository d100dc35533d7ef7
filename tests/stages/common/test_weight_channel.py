"""The weight channel (stages/common/weight_channel.py, weight_receiver.py) between real processes over gloo: what a
member receives is the checkpoint bit for bit, a corrupted file is refused, and a member killed
mid-receive breaks only that generation: the sender says so in one line and the next send opens a
new one for the group the driver starts in its place."""

from __future__ import annotations

import base64
import logging
import multiprocessing as mp
import os
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from rlpipe.schemas.hashing import digest_bytes
from rlpipe.schemas.manifest import FileInfo, Manifest, content_hash
from rlpipe.stages.common import (
    device_weights,
    handoff,
    shared_weights,
    weight_channel,
    weight_receiver,
)
from rlpipe.stages.common.weight_channel import PACK_BYTES, Address, Sender, broadcast_plan
from rlpipe.stages.common.weight_delivery import Delivery, check_delivery, safetensors_views
from rlpipe.stages.common.weight_file import WeightFile

# Small buckets, so each file goes in several broadcasts (the header tells the members the size).
BUCKET = 64 << 10
TIMEOUT_S = 60.0


def checkpoint(seed: int, rows: int = 300) -> tuple[dict[str, torch.Tensor], dict[str, bytes], Manifest]:
    g = torch.Generator().manual_seed(seed)
    tensors = {"embed.weight": torch.randn(rows, 64, generator=g), "norm.weight": torch.randn(64, generator=g).bfloat16(),
               "steps": torch.arange(7, dtype=torch.int64)}
    files = {"model.safetensors": save(tensors), "config.json": b'{"model_type": "llama"}'}
    infos = sorted((FileInfo.of(n, len(d), digest_bytes(d)) for n, d in files.items()), key=lambda f: f.name)
    return tensors, files, Manifest(kind="checkpoint", files=infos, content_hash=content_hash(infos), stage="optimize")


def raw(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """A tensor as plain data (dtype, shape, bytes): what crosses the test's result queue."""
    return str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes()


def _member(folder: str, group: str, member: int, policies: list[str], results,
            die_after_buckets: int | None = None, die_mapping: bool = False, gpu_double: bool = False) -> None:
    """A rollout member's receiving end in its own process: puts (member, policy, tensors) for each
    policy it is asked for (None when it got none)."""
    if gpu_double:  # (`_gpu_double`'s receiving half)
        device_weights.open_handle = lambda handle: torch.frombuffer(bytearray(base64.b64decode(handle["bytes"])),
                                                                     dtype=torch.uint8)
    if die_mapping:  # a member killed as it maps the shared-memory file
        shared_weights.read = lambda *a: os._exit(9)
    if die_after_buckets is not None:  # a member killed mid-receive: gone after n buckets
        seen = [0]
        real = weight_channel.broadcast

        def dying(group, tensor):
            real(group, tensor)
            seen[0] += 1
            if seen[0] >= die_after_buckets:
                os._exit(9)
        weight_channel.broadcast = dying
    receiver = weight_receiver.Receiver(Path(folder), group, member, timeout_s=TIMEOUT_S).start()
    for policy in policies:
        delivery = receiver.take(Path(folder) / policy, timeout_s=TIMEOUT_S)
        results.put((member, policy, None if delivery is None else
                     ({k: raw(v) for k, v in delivery.tensors().items()}, delivery.small_files(),
                      delivery.manifest.content_hash)))


def _start(ctx, folder: Path, group: str, member: int, policies: list[str], results, **kw):
    p = ctx.Process(target=_member, args=(str(folder), group, member, policies, results), kwargs=kw)
    p.start()
    return p


def test_safetensors_views_are_the_tensors_saved():
    tensors, files, _ = checkpoint(0)
    views = safetensors_views(torch.frombuffer(bytearray(files["model.safetensors"]), dtype=torch.uint8))
    assert views.keys() == tensors.keys()
    for name, t in tensors.items():
        assert views[name].dtype == t.dtype and torch.equal(views[name], t)


def test_the_broadcast_plan_packs_small_pieces_and_parts_large_ones():
    """Small pieces packed up to a bucket, a large one alone in bucket-sized parts, empty ones
    skipped: the broadcasts, back to back, are the file."""
    big = PACK_BYTES + 5
    plan = broadcast_plan([10, 0, 700, big, 300, 300, 500, 1], bucket=1024)
    parts = [[(3, b, min(b + 1024, big))] for b in range(0, big, 1024)]
    assert len(parts) == 1025 and parts[-1] == [(3, 1048576, big)]
    assert plan == [[(0, 0, 10), (2, 0, 700)], *parts, [(4, 0, 300), (5, 0, 300)], [(6, 0, 500), (7, 0, 1)]]


def _shared_files() -> set[Path]:
    return set(shared_weights.SHM.glob(f"{shared_weights.PREFIX}-*-{os.getpid()}-*"))


@pytest.mark.slow  # (three processes importing torch)
@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "broadcast"])
def test_members_receive_each_checkpoint_bit_for_bit(tmp_path, shared_memory, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="rlpipe")
    written = []  # the inode of each shared-memory file as written: the members unlink it once mapped

    def write(*args, **kwargs):
        path = real_write(*args, **kwargs)
        written.append(None if path is None else path.stat().st_ino)
        return path
    real_write = shared_weights.write
    monkeypatch.setattr(shared_weights, "write", write)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    members = [_start(ctx, tmp_path, "rollout-a", m, ["policy_1", "policy_2"], results) for m in range(2)]
    sender = Sender(tmp_path, 2, timeout_s=TIMEOUT_S, host="127.0.0.1", bucket_bytes=BUCKET,
                    shared_memory=shared_memory)
    sent, spares = {}, []
    for k in (1, 2):
        tensors, files, manifest = checkpoint(k)
        if k == 2:  # a file sent as its pieces (as a hand-over sends a safetensors header, then each tensor)
            data = files["model.safetensors"]
            files = {**files, "model.safetensors": [data[:10], b"", memoryview(data)[10:BUCKET + 3], data[BUCKET + 3:]]}
            # (as the next order that sends starts: the shared-memory file of the next hand-off allocated
            # beforehand, of the last one's size, which the same shapes keep)
            sender.prepare()
            sender.spare._join()
            spares = [(p, p.stat().st_ino) for p in _shared_files()]
        assert sender.send(tmp_path / f"policy_{k}", manifest, files, "rollout-a")
        if k == 2 and shared_memory:  # the second went through the spare, written in place
            assert len(spares) == 1 and written[-1] == spares[0][1]
        sent[f"policy_{k}"] = (tensors, manifest.content_hash)
        got = sorted(results.get(timeout=TIMEOUT_S) for _ in range(2))
        for member, (m, policy, delivery) in enumerate(got):
            assert (m, policy) == (member, f"policy_{k}")
            tensors_got, small, hash_got = delivery
            assert hash_got == sent[policy][1]
            assert small == {"config.json": b'{"model_type": "llama"}'}
            assert tensors_got == {name: raw(t) for name, t in sent[policy][0].items()}
    assert Address.read(tmp_path).generation == 1  # one generation served both
    # the members of this machine took the shared-memory path when offered it, and no file is left
    # (the last member to map one removes it; the broadcast prepares no spare)
    assert sender.local == shared_memory and not _shared_files() and len(spares) == shared_memory
    assert caplog.text.count("(shared memory)") == (2 if shared_memory else 0)  # (the sender's log lines)
    sender.close()
    for p in members:
        p.join(TIMEOUT_S)


def _gpu_double(files, members):
    """A stand-in for `device_weights.offer` where CUDA IPC cannot run (no GPU here): the "handle"
    carries the file's bytes themselves. What it checks is the channel around it: weight files
    handed over apart from the others, merged back and checked on the member."""
    assert members == [[], []]  # (what each member of this machine said it sees: no GPU)
    return [], {name: {"bytes": base64.b64encode(file.to_bytes()).decode(), "size": len(file)}
                for name, file in files.items()}


@pytest.mark.slow
def test_weight_files_handed_over_apart_reach_the_members_whole(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="rlpipe")
    monkeypatch.setattr(device_weights, "offer", _gpu_double)
    through_shared_memory = []
    write = shared_weights.write
    monkeypatch.setattr(shared_weights, "write", lambda tag, pieces, **kw: through_shared_memory.append(sorted(pieces))
                        or write(tag, pieces))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    members = [_start(ctx, tmp_path, "rollout-a", m, ["policy_1"], results, gpu_double=True) for m in range(2)]
    sender = Sender(tmp_path, 2, timeout_s=TIMEOUT_S, host="127.0.0.1")
    tensors, files, manifest = checkpoint(1)
    header, order = handoff._layout(files["model.safetensors"], tensors)
    assert sender.send(tmp_path / "policy_1", manifest, files, "rollout-a",
                       {"model.safetensors": WeightFile(header, [tensors[name] for name in order])})
    for _ in range(2):
        _, policy, (got, small, hash_got) = results.get(timeout=TIMEOUT_S)
        assert hash_got == manifest.content_hash and small == {"config.json": b'{"model_type": "llama"}'}
        assert got == {name: raw(t) for name, t in tensors.items()}
    assert through_shared_memory == [["config.json"]]  # (the shared-memory file held only the other files)
    assert f"sent policy_1 ({(len(files['model.safetensors']) + len(files['config.json'])) / 1e6:.1f} MB)" in caplog.text
    assert "(on the GPU, shared memory)" in caplog.text
    sender.close()
    for p in members:
        p.join(TIMEOUT_S)


@pytest.mark.slow
def test_a_member_killed_mid_receive_breaks_one_generation(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="rlpipe")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    dying = _start(ctx, tmp_path, "rollout-a", 1, ["policy_1"], results, die_after_buckets=1)
    alive = _start(ctx, tmp_path, "rollout-a", 0, ["policy_1"], results)
    sender = Sender(tmp_path, 2, timeout_s=TIMEOUT_S, host="127.0.0.1", bucket_bytes=BUCKET, shared_memory=False)
    # 16 MB: far more than the sockets' buffers take in, so the sender sees the member gone
    _, files, manifest = checkpoint(1, rows=64 << 10)
    assert not sender.send(tmp_path / "policy_1", manifest, files, "rollout-a")
    dying.join(TIMEOUT_S)
    assert dying.exitcode == 9
    # the file is written as the record (here: its manifest appears); the survivor, whose receive
    # broke, uses nothing half-received and reads that file
    (tmp_path / "policy_1").mkdir()
    (tmp_path / "policy_1" / "_manifest.json").write_text(manifest.model_dump_json())
    assert results.get(timeout=TIMEOUT_S) == (0, "policy_1", None)
    out = caplog.text
    assert out.count("sending") == 1 and "the rollout members read its file" in out
    # the driver starts the group anew (a group folder of its own): its members join a new generation
    new_group = [_start(ctx, tmp_path, "rollout-b", m, ["policy_2"], results) for m in range(2)]
    tensors, files, manifest = checkpoint(2)
    assert sender.send(tmp_path / "policy_2", manifest, files, "rollout-b")
    assert Address.read(tmp_path).generation == 2
    for _ in range(2):
        _, policy, (got, _, hash_got) = results.get(timeout=TIMEOUT_S)
        assert policy == "policy_2" and hash_got == manifest.content_hash
        assert got == {name: raw(t) for name, t in tensors.items()}
    sender.close()
    for p in (alive, *new_group):
        p.join(TIMEOUT_S)


@pytest.mark.parametrize("corrupt", ["bytes", "size"])
def test_a_file_that_does_not_match_its_manifest_is_refused(corrupt, capsys):
    tensors, files, manifest = checkpoint(3)
    data = bytearray(files["model.safetensors"])
    if corrupt == "bytes":
        data[-1] ^= 1
    else:
        data += b"\0"
    received = {"model.safetensors": torch.frombuffer(data, dtype=torch.uint8),
                "config.json": torch.frombuffer(bytearray(files["config.json"]), dtype=torch.uint8)}
    problem = check_delivery(manifest, received)
    assert problem == ("with model.safetensors not matching its hash" if corrupt == "bytes" else
                       f"with model.safetensors of {len(data)} bytes, not {len(data) - 1}")
    intact = {n: torch.frombuffer(bytearray(d), dtype=torch.uint8) for n, d in files.items()}
    assert check_delivery(manifest, intact) is None
    assert Delivery(Path("p"), manifest, intact).tensors().keys() == tensors.keys()


@pytest.mark.slow
def test_a_member_killed_before_it_maps_the_shared_file(tmp_path):
    """The sender does not wait on the members of the shared-memory path: a member killed as it maps
    the file costs the send nothing; the survivor takes the policy; the file goes at the next send
    (the last member to map a file removes it: here the dead one never does)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    dying = _start(ctx, tmp_path, "rollout-a", 1, ["policy_1"], results, die_mapping=True)
    alive = _start(ctx, tmp_path, "rollout-a", 0, ["policy_1", "policy_2"], results)
    sender = Sender(tmp_path, 2, timeout_s=TIMEOUT_S, host="127.0.0.1")
    tensors, files, manifest = checkpoint(1)
    assert sender.send(tmp_path / "policy_1", manifest, files, "rollout-a") and sender.local
    _, policy, (got, _, hash_got) = results.get(timeout=TIMEOUT_S)
    assert policy == "policy_1" and hash_got == manifest.content_hash
    assert got == {name: raw(t) for name, t in tensors.items()}
    dying.join(TIMEOUT_S)
    assert dying.exitcode == 9 and len(_shared_files()) == 1  # (mapped by one member of two)
    first = _shared_files()
    tensors, files, manifest = checkpoint(2)
    assert sender.send(tmp_path / "policy_2", manifest, files, "rollout-a")
    _, policy, (got, _, hash_got) = results.get(timeout=TIMEOUT_S)
    assert policy == "policy_2" and got == {name: raw(t) for name, t in tensors.items()}
    assert _shared_files() and not _shared_files() & first  # the first file went with the second send
    sender.close()
    assert not _shared_files()
    alive.join(TIMEOUT_S)


def test_a_killed_senders_shared_files_are_swept():
    """A sender killed mid-send leaves its file; the next sender of the machine removes the files
    of senders whose process is gone, and only those."""
    gone = mp.get_context("spawn").Process(target=os.getpid)
    gone.start()
    gone.join()
    host = socket.gethostname()
    left = shared_weights.SHM / f"{shared_weights.PREFIX}-{host}-{gone.pid}-3-1"
    ours = shared_weights.SHM / f"{shared_weights.PREFIX}-{host}-{os.getpid()}-3-1"
    for path in (left, ours):
        path.write_bytes(b"weights")
    try:
        shared_weights.sweep()
        assert not left.exists() and ours.exists()
    finally:
        shared_weights.remove(ours)
        shared_weights.remove(left)


def test_a_spare_shared_file_is_written_in_place_when_it_has_the_size_and_goes_otherwise():
    """The next hand-off's shared-memory file is allocated beforehand (`Spare`): taken by a write of
    its size (the same file, holding the pieces back to back), removed for any other size, with
    the sender, and never left behind."""
    pieces = {"model.safetensors": [b"h" * 10, memoryview(bytearray(b"w" * 1000)), b""], "config.json": [b"{}"]}
    spare = shared_weights.Spare()
    written = None
    try:
        spare.prepare(1012)
        spare._join()
        (allocated,) = _shared_files()
        assert allocated.stat().st_size == 1012
        inode = allocated.stat().st_ino
        written = shared_weights.write("9-1", pieces, spare=spare.take(1012))
        assert written.stat().st_ino == inode and not allocated.exists()
        assert written.read_bytes() == b"h" * 10 + b"w" * 1000 + b"{}"
        spare.prepare(1012)
        assert spare.take(1011) is None and _shared_files() == {written}  # (the wrong size: gone)
        spare.prepare(1012)
        spare.discard()
        assert _shared_files() == {written}
    finally:
        spare.discard()
        shared_weights.remove(written)
    assert not _shared_files()


def test_a_member_waits_for_the_next_header_without_a_word(capfd):
    """A member waits for each hand-off's header on the channel's store for as long as an iteration
    lasts, and its log stays quiet: torch's store logs two warning lines for each wait that times
    out (with waits of a second, two lines a second of every iteration)."""
    import threading
    from datetime import timedelta

    master = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    member = torch.distributed.TCPStore("127.0.0.1", master.port, 2, is_master=False, timeout=timedelta(seconds=30))
    threading.Timer(2.5, lambda: master.set("weights/1/header/1", "{}")).start()
    assert weight_receiver._poll(member, "weights/1/header/1", lambda: False) == "{}"
    assert "waitForInput" not in capfd.readouterr().err


def _two_files(seed: int) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, bytes], Manifest]:
    """A checkpoint of two weight files (a small one, then 16 MB) and a config, as ZeRO-3's two
    ranks share it out: rank 0 sends the first and the config, rank 1 the second."""
    g = torch.Generator().manual_seed(seed)
    tensors = {"model-00001-of-00002.safetensors": {"norm.weight": torch.randn(300, 64, generator=g)},
               "model-00002-of-00002.safetensors": {"embed.weight": torch.randn(64 << 10, 64, generator=g)}}
    files = {**{name: save(t) for name, t in tensors.items()}, "config.json": b'{"model_type": "llama"}'}
    infos = sorted((FileInfo.of(n, len(d), digest_bytes(d)) for n, d in files.items()), key=lambda f: f.name)
    return tensors, files, Manifest(kind="checkpoint", files=infos, content_hash=content_hash(infos), stage="optimize")


def _sender(folder: str, rank: int, port: int, results) -> None:
    """An optimize rank of a 2-rank ZeRO-3 job in its own process: sends its part of policy_1 to
    group rollout-a, then of policy_2 to rollout-b; puts (rank, policy, sent)."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    sender = Sender(Path(folder), 2, rank=rank, timeout_s=TIMEOUT_S, host="127.0.0.1", bucket_bytes=BUCKET,
                    shared_memory=False)
    for k, group in ((1, "rollout-a"), (2, "rollout-b")):
        _, files, manifest = _two_files(k)
        mine = (["model-00001-of-00002.safetensors", "config.json"] if rank == 0
                else ["model-00002-of-00002.safetensors"])
        sent = sender.send(Path(folder) / f"policy_{k}", manifest, {n: files[n] for n in mine}, group, senders=2)
        results.put((rank, f"policy_{k}", sent))
    sender.close()
    torch.distributed.destroy_process_group()


@pytest.mark.slow  # (six processes importing torch)
def test_two_senders_send_their_own_files_and_fail_together(tmp_path):
    """ZeRO-3's two ranks each send their own files (a group per sender): a member killed during
    rank 1's part fails the hand-off on both ranks (the members read the file) and only that
    generation; the next, for the group started anew, delivers both ranks' files bit for bit."""
    ctx = mp.get_context("spawn")
    results, sent = ctx.Queue(), ctx.Queue()
    # (rank 0's part takes 3 broadcasts: the member dies in rank 1's, of 16 MB)
    dying = _start(ctx, tmp_path, "rollout-a", 1, ["policy_1"], results, die_after_buckets=4)
    alive = _start(ctx, tmp_path, "rollout-a", 0, ["policy_1"], results)
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    senders = [ctx.Process(target=_sender, args=(str(tmp_path), r, port.getsockname()[1], sent)) for r in range(2)]
    port.close()
    for p in senders:
        p.start()
    assert sorted(sent.get(timeout=4 * TIMEOUT_S) for _ in range(2)) == [(0, "policy_1", False), (1, "policy_1", False)]
    dying.join(TIMEOUT_S)
    assert dying.exitcode == 9
    _, _, manifest = _two_files(1)
    (tmp_path / "policy_1").mkdir()  # (the record, written as the members were told to read it)
    (tmp_path / "policy_1" / "_manifest.json").write_text(manifest.model_dump_json())
    assert results.get(timeout=TIMEOUT_S) == (0, "policy_1", None)
    new_group = [_start(ctx, tmp_path, "rollout-b", m, ["policy_2"], results) for m in range(2)]
    assert sorted(sent.get(timeout=4 * TIMEOUT_S) for _ in range(2)) == [(0, "policy_2", True), (1, "policy_2", True)]
    tensors, _, manifest = _two_files(2)
    assert Address.read(tmp_path).senders == 2
    for _ in range(2):
        _, policy, (got, small, hash_got) = results.get(timeout=TIMEOUT_S)
        assert policy == "policy_2" and hash_got == manifest.content_hash
        assert small == {"config.json": b'{"model_type": "llama"}'}
        assert got == {name: raw(t) for file in tensors.values() for name, t in file.items()}
    for p in (alive, *new_group, *senders):
        p.join(TIMEOUT_S)
        assert p.exitcode == 0
