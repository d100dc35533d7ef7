"""The weight channel's same-GPU path (stages/common/device_weights.py; run with `-m gpu`, skipped
without a GPU): members on the sender's GPU take the weight files from it through CUDA IPC, bit for
bit, as CUDA tensors, the other files through shared memory; a member that does not see that GPU
makes the sender keep to shared memory, with the same bytes."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from rlpipe.stages.common import handoff, weight_receiver
from rlpipe.stages.common.weight_channel import Sender
from rlpipe.stages.common.weight_file import WeightFile

from .test_weight_channel import TIMEOUT_S, checkpoint, raw

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def _member(folder: str, member: int, policy: str, results, hide_gpus: bool) -> None:
    if hide_gpus:  # (before CUDA starts in this process: it sees no GPU)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    else:  # (CUDA started, as in a member whose model is on the GPU: it says it uses that GPU)
        torch.zeros(1, device="cuda")
    receiver = weight_receiver.Receiver(Path(folder), "rollout-a", member, timeout_s=TIMEOUT_S).start()
    delivery = receiver.take(Path(folder) / policy, timeout_s=TIMEOUT_S)
    results.put((member, None if delivery is None else (
        delivery.files["model.safetensors"].device.type, {k: raw(v.cpu()) for k, v in delivery.tensors().items()},
        delivery.small_files(), delivery.manifest.content_hash)))
    receiver.stop()


@pytest.mark.parametrize("hide_gpus", [False, True], ids=["same-gpu", "a-member-without-it"])
def test_members_on_the_senders_gpu_take_the_weights_there(tmp_path, caplog, hide_gpus):
    caplog.set_level(logging.INFO, logger="rlpipe")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    members = [ctx.Process(target=_member, args=(str(tmp_path), m, "policy_1", results, hide_gpus and m == 1))
               for m in range(2)]
    for p in members:
        p.start()
    tensors, files, manifest = checkpoint(1)
    header, order = handoff._layout(files["model.safetensors"], tensors)
    on_gpu = {"model.safetensors": WeightFile(header, [tensors[name].to("cuda") for name in order])}
    sender = Sender(tmp_path, 2, timeout_s=TIMEOUT_S, host="127.0.0.1")
    assert sender.send(tmp_path / "policy_1", manifest, files, "rollout-a", on_gpu)
    got = dict(results.get(timeout=TIMEOUT_S) for _ in range(2))
    for m in range(2):
        device, tensors_got, small, hash_got = got[m]
        assert device == ("cpu" if hide_gpus else "cuda"), m
        assert hash_got == manifest.content_hash
        assert small == {"config.json": b'{"model_type": "llama"}'}
        assert tensors_got == {name: raw(t) for name, t in tensors.items()}
    assert ("on the GPU" in caplog.text) != hide_gpus and "shared memory" in caplog.text
    for p in members:
        p.join(TIMEOUT_S)
    sender.close()
