"""ZeRO-3's policy handed over by every rank (stages/common/partitioned_handoff.py): optimize on 2
ranks (torchrun, gloo, a bf16 engine), 2 rollout members receiving over the weight channel.

- The first save learns the files' layout with the model gathered to rank 0; every later one is
  shared out: each rank gathers, sends and writes only its own files (neither keeps the whole
  model), and both send (the members join a group per sender).
- What the members receive and what is written are, bit for bit, the checkpoint the whole model
  gathered to rank 0 saves (`deepspeed.save_pretrained`).
- Rank 0 SIGKILLed after sending and before the manifest (its own files written, rank 1's written
  or on their way): the policy is not there, and the rerun writes every checkpoint with the
  uninterrupted run's hashes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from architectures import build_model
from safetensors.torch import load_file

from rlpipe.cluster.launch import free_port, local_env, torchrun_executable
from rlpipe.schemas.hashing import digest_bytes

SAVES = 3
SHARD = "40KB"  # (several weight files, so both ranks own some)

# Runs on each optimize rank: argv = out folder, checkpoint, channel folder, the save to kill rank 0 at
# (-1: none), the shard size, how the members on this machine take the files, the saves.
DRIVER = r"""
import json, os, signal, sys, time
from pathlib import Path
from types import SimpleNamespace

import torch

from rlpipe.stages.common import deepspeed as ds, partitioned_handoff
from rlpipe.stages.common.background import wait_for_background
from rlpipe.stages.common.channel_end import CHANNEL
from rlpipe.stages.common.distributed import init_distributed
from rlpipe.stages.common.tiny import load_checkpoint
from rlpipe.stages.optimize import run

info = init_distributed()
out, folder, channel, kill_at = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
model, tokenizer = load_checkpoint(folder)
config = ds.ds_config(3, micro_batch_size=2, grad_accum=1, world_size=2, grad_clip=1.0, bf16=True)
engine = ds.make_engine(model, config, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
optimize = SimpleNamespace(max_shard_size=sys.argv[5], dtype="fp32", policy_weights="every_iteration",
                           train_state_output=None)
CHANNEL.order_sends_to(channel, (2, "rollout"), info.rank)
CHANNEL.sender.shared_memory = sys.argv[6] == "shared-memory"  # (else each sender broadcasts in its group)
real_to, kept, record = ds._gathered_to, [0], {}


def counting_to(param, writer, to="cpu"):
    whole = real_to(param, writer, to)
    kept[0] += 0 if whole is None else whole.numel()
    return whole


ds._gathered_to = counting_to
for k in range(int(sys.argv[7])):
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(100 * k + info.rank))
    engine.backward(engine(input_ids=ids).logits.float().pow(2).mean())
    engine.step()
    if k == kill_at and info.rank == 0:  # killed after sending, rank 1's files written, before the manifest
        partitioned_handoff._wait_for_files = lambda *a: (time.sleep(1.0), os.kill(os.getpid(), signal.SIGKILL))
    kept[0] = 0
    manifest = run._hand_over_policy(ds, optimize, engine, tokenizer, out / f"policy_{k}", info.rank, True,
                                     dict(stage="optimize"))
    record[k] = {"kept": kept[0], "hash": manifest.content_hash, "total": sum(p.ds_numel for p in engine.module.parameters()),
                 "senders": CHANNEL.sender.senders}
    ds.save_pretrained(engine, tokenizer, out / f"whole_{k}", info.rank, keep_copy=False, max_shard_size=sys.argv[5])
    wait_for_background()
    while not all((channel / f"got-{m}-policy_{k}").exists() for m in range(2)):  # (each taken before the next)
        time.sleep(0.05)
    torch.distributed.barrier()
(out / f"record.{info.rank}.json").write_text(json.dumps(record))
"""

# A rollout member: argv = channel folder, member, out folder, policies; writes what it received.
MEMBER = r"""
import hashlib, json, sys
from pathlib import Path

import torch

from rlpipe.stages.common.weight_receiver import Receiver

folder, member, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
receiver = Receiver(folder, "rollout", member, timeout_s=60.0).start()
for policy in sys.argv[4:]:
    delivery = receiver.take(out / policy, timeout_s=300.0)
    got = None if delivery is None else {
        "hash": delivery.manifest.content_hash,
        "tensors": {n: [str(t.dtype), list(t.shape),
                        hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()]
                    for n, t in delivery.tensors().items()}}
    (folder / f"member-{member}-{policy}.json").write_text(json.dumps(got))
    (folder / f"got-{member}-{policy}").touch()
"""


def _raw(t: torch.Tensor) -> list:
    import hashlib

    return [str(t.dtype), list(t.shape), hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()]


def _run(tmp_path: Path, name: str, checkpoint: Path, policies: list[str], kill_at: int = -1,
         out: Path | None = None) -> tuple[subprocess.CompletedProcess, Path, Path]:
    out = out or tmp_path / name / "out"
    channel = tmp_path / name / f"workers-{kill_at}"
    channel.mkdir(parents=True)
    env = local_env(threads_per_rank=1) | {"PYTHONPATH": os.pathsep.join(sys.path)}
    members = [subprocess.Popen([sys.executable, "-c", MEMBER, str(channel), str(m), str(out), *policies], env=env)
               for m in range(2)]
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    cmd = [torchrun_executable(), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
           str(free_port()), str(driver), str(out), str(checkpoint), str(channel), str(kill_at), SHARD,
           "shared-memory" if kill_at < 0 and out.parent.name == "whole" else "broadcast", str(SAVES)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    for p in members:
        try:
            p.wait(120)
        except subprocess.TimeoutExpired:
            p.kill()
    return done, out, channel


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.multiprocess
def test_every_rank_sends_and_writes_its_own_files_bit_for_bit(tmp_path, tiny_tokenizer):
    from rlpipe.stages.common.tiny import save_pretrained

    checkpoint = save_pretrained(build_model("gpt2", tiny_tokenizer, seed=1), tiny_tokenizer, tmp_path / "gpt2")
    policies = [f"policy_{k}" for k in range(SAVES)]
    done, out, channel = _run(tmp_path, "whole", checkpoint, policies)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    records = [json.loads((out / f"record.{r}.json").read_text()) for r in range(2)]
    for k in range(SAVES):
        policy, whole = out / f"policy_{k}", out / f"whole_{k}"
        manifest = json.loads((policy / "_manifest.json").read_text())
        assert {r[str(k)]["hash"] for r in records} == {manifest["content_hash"]}
        weights = sorted(p.name for p in whole.glob("*.safetensors"))
        assert len(weights) >= 3, weights  # (several files, to share out)
        # the checkpoint written is the whole-gathered one, bit for bit, and its manifest hashes it
        assert sorted(p.name for p in policy.iterdir() if p.name != "_manifest.json") == sorted(
            p.name for p in whole.iterdir())
        for f in whole.iterdir():
            assert (policy / f.name).read_bytes() == f.read_bytes(), (k, f.name)
        assert {f["name"]: f["xxh3_128"] for f in manifest["files"]} == {
            f.name: digest_bytes(f.read_bytes(), "xxh3_128") for f in whole.iterdir()}
        # ... and so is what each member received
        tensors = {}
        for name in weights:
            tensors.update({n: _raw(t) for n, t in load_file(whole / name).items()})
        for m in range(2):
            got = json.loads((channel / f"member-{m}-policy_{k}.json").read_text())
            assert got == {"hash": manifest["content_hash"], "tensors": tensors}, (k, m)
        total = records[0][str(k)]["total"]
        if k == 0:  # learnt from a save through transformers: gathered to rank 0, sent by it alone
            assert [r[str(k)]["kept"] for r in records] == [total, 0]
            assert [r[str(k)]["senders"] for r in records] == [1, 1]
        else:  # shared out: each rank gathered some of it, neither all, and both sent
            kept = [r[str(k)]["kept"] for r in records]
            assert sum(kept) == total and all(0 < n < total for n in kept), (k, kept, total)
            assert [r[str(k)]["senders"] for r in records] == [2, 2]

    # rank 0 killed after sending policy_1 and before its manifest: nothing of it is visible; the
    # rerun writes every checkpoint with the uninterrupted run's hashes
    killed, again, channel = _run(tmp_path, "killed", checkpoint, policies[:2], kill_at=1)
    assert killed.returncode != 0
    for k in range(2):  # (sent before the kill; broadcast by each sender in its group, this time)
        first = json.loads((out / f"policy_{k}" / "_manifest.json").read_text())["content_hash"]
        assert [json.loads((channel / f"member-{m}-policy_{k}.json").read_text())["hash"] for m in range(2)] == [
            first, first]
    assert (again / "policy_0" / "_manifest.json").is_file() and not (again / "policy_1").exists()
    left = again / ".policy_1.staging"
    assert left.is_dir() and not (left / "_manifest.json").exists()  # (rank 1's files, maybe)
    rerun, again, _ = _run(tmp_path, "rerun", checkpoint, policies, out=again)
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-4000:]
    assert not left.exists()
    for k in range(SAVES):
        first = json.loads((out / f"policy_{k}" / "_manifest.json").read_text())["content_hash"]
        assert json.loads((again / f"policy_{k}" / "_manifest.json").read_text())["content_hash"] == first


def test_each_file_goes_to_the_least_loaded_rank_largest_first():
    from safetensors.torch import save

    from rlpipe.stages.common.partitioned_handoff import FilePlan, _file_size

    def header(elements: int) -> bytes:
        data = save({"w": torch.zeros(elements)})
        return data[:8 + int.from_bytes(data[:8], "little")]

    weights = {f"model-{i}.safetensors": (header(n), ["w"]) for i, n in enumerate([20, 50, 10, 40, 30])}
    assert {name: _file_size(h) for name, (h, _) in weights.items()} == {
        name: len(save({"w": torch.zeros(n)})) for name, n in zip(weights, [20, 50, 10, 40, 30], strict=True)}
    plan = FilePlan((), ("", ""), "5GB", {}, weights)
    # 50 -> 0, 40 -> 1, 30 -> 1 (40 < 50), 20 -> 0 (50 < 70), 10 -> 0 (70 = 70: the lower rank)
    assert plan.owners(2) == {"model-1.safetensors": 0, "model-3.safetensors": 1, "model-4.safetensors": 1,
                              "model-0.safetensors": 0, "model-2.safetensors": 0}
    assert set(plan.owners(8).values()) == {0, 1, 2, 3, 4}  # (more ranks than files: one file each)
    assert set(plan.owners(1).values()) == {0}
