"""The policy handed over in memory (stages/common/handoff.py): the checkpoint written in the
background holds the very bytes `save_pretrained` writes, its manifest is known before the write,
the copy handed over equals loading that checkpoint, on every architecture of the matrix."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from architectures import ARCHITECTURES, build_model

from rlpipe.schemas import pending, read_manifest
from rlpipe.schemas.errors import ArtifactError
from rlpipe.schemas.verify import verify_checkpoint
from rlpipe.schemas.writer import commit_directory
from rlpipe.stages.common import background, handoff
from rlpipe.stages.common.tiny import load_checkpoint, save_pretrained

FIELDS = dict(stage="optimize", config={"lr": 1.0}, cache_key="k")


@pytest.fixture
def in_background(fresh_process_state):
    """Background saves allowed; afterwards waited for, disallowed and no write pending (the
    process-wide state reset)."""
    background.allow_background()
    yield


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.name != "_manifest.json"}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_handed_over_checkpoint_is_what_save_pretrained_writes(name, tiny_tokenizer, tmp_path, in_background):
    tok = copy.deepcopy(tiny_tokenizer)
    model = build_model(name, tok)
    with torch.no_grad():  # weights away from their init, the LM head's tie (where tied) kept
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    manifest, host = handoff.hand_over(model, tok, tmp_path / "handed", max_shard_size="5GB", manifest_fields=FIELDS)
    background.wait_for_background()
    saved = save_pretrained(model, tok, tmp_path / "saved")
    reference = commit_directory(saved, **FIELDS)
    # the same files, byte for byte, so the same content hash as the synchronous save
    assert _files(tmp_path / "handed") == _files(saved)
    assert manifest.content_hash == reference.content_hash == read_manifest(tmp_path / "handed").content_hash
    assert verify_checkpoint(tmp_path / "handed").content_hash == manifest.content_hash
    # the copy handed over is what loading the checkpoint gives: every tensor, and the logits
    loaded, _ = load_checkpoint(tmp_path / "handed")
    want, got = loaded.state_dict(), host.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), name
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        assert torch.equal(host(input_ids=ids).logits, loaded(input_ids=ids).logits)
    tied = [n for n, p in model.named_parameters(remove_duplicate=False)]
    host_params = dict(host.named_parameters(remove_duplicate=False))
    assert len(host_params) == len(tied)  # as many names, ties shared as in the model
    assert {id(p) for p in host.parameters()}.__len__() == len(list(model.parameters()))


def test_a_policy_handed_over_again_is_laid_out_as_safetensors_lays_it_out(tiny_tokenizer, tmp_path, in_background):
    """After the first file of a layout (which safetensors serialises), the next ones are written
    from their tensors behind the same header: still byte for byte what `save_pretrained` writes,
    and the copy handed over shares the snapshots (fp32: no second copy)."""
    model = build_model("llama", tiny_tokenizer)
    for n in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        # the last one without a copy, from the model's own tensors (as a resident optimize sends)
        manifest, host = handoff.hand_over(model, tiny_tokenizer, tmp_path / f"handed{n}", max_shard_size="5GB",
                                           manifest_fields=FIELDS, copy=n < 2, stable=n == 2)
        saved = save_pretrained(model, tiny_tokenizer, tmp_path / f"saved{n}")
        background.wait_for_background()
        assert _files(tmp_path / f"handed{n}") == _files(saved), n
        assert manifest.content_hash == commit_directory(saved, **FIELDS).content_hash
        if host is None:
            continue
        with torch.no_grad():  # the copy is a snapshot: training on does not move it
            before = {k: v.clone() for k, v in host.state_dict().items()}
            for p in model.parameters():
                p.add_(1.0)
            assert all(torch.equal(before[k], v) for k, v in host.state_dict().items())
            for p in model.parameters():
                p.sub_(1.0)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_later_saves_write_what_save_pretrained_writes_without_it(name, tiny_tokenizer, tmp_path, in_background,
                                                                   monkeypatch):
    """After a module's first hand-over, the next ones write its files from the form kept of the
    first (`SavedForm`): byte for byte `save_pretrained`'s files on every architecture (tied heads,
    converted weights), without calling it; a changed config, another tokenizer or another module
    goes through `save_pretrained` again."""
    from rlpipe.stages.common import tiny

    calls = []
    real = tiny.save_pretrained
    monkeypatch.setattr(tiny, "save_pretrained", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    tok = copy.deepcopy(tiny_tokenizer)
    model = build_model(name, tok)

    def handed(n, module=model, tokenizer=tok):
        with torch.no_grad():
            for p in module.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        manifest, _ = handoff.hand_over(module, tokenizer, tmp_path / f"handed{n}", max_shard_size="5GB",
                                        manifest_fields=FIELDS, copy=n % 2 == 0, stable=True)
        background.wait_for_background()
        saved = real(module, tokenizer, tmp_path / f"saved{n}")
        assert _files(tmp_path / f"handed{n}") == _files(saved), (name, n)
        assert manifest.content_hash == commit_directory(saved, **FIELDS).content_hash
        return len(calls)

    if name in SAVED_AS_BUILT:  # every save through transformers, still byte for byte
        assert [handed(n) for n in range(3)] == [1, 2, 3]
        return
    assert [handed(n) for n in range(3)] == [1, 1, 1]  # (the first save only)
    model.config.rlpipe_note = "changed"  # a config change shows in config.json: saved through transformers
    assert handed(3) == 2
    assert handed(4, tokenizer=copy.deepcopy(tok)) == 3
    other = build_model(name, tok)
    assert handed(5, module=other) == 4
    assert handed(6, module=other) == 4


#: Architectures whose checkpoints transformers writes from tensors it builds as it saves (the
#: mixtures of experts: one tensor per expert from the fused module's), which `SavedForm` leaves
#: to transformers.
SAVED_AS_BUILT = {"qwen2_moe", "mixtral", "olmoe"}


def test_the_manifest_is_known_before_the_files_and_readers_wait(tiny_tokenizer, tmp_path, in_background):
    model = build_model("llama", tiny_tokenizer)
    gate = threading.Event()
    background.in_background(gate.wait, "a save before this one")  # holds the write back
    out = tmp_path / "policy"
    manifest, _ = handoff.hand_over(model, tiny_tokenizer, out, max_shard_size="5GB", manifest_fields=FIELDS)
    assert not out.exists()  # nothing visible to other processes yet
    assert read_manifest(out) == manifest  # this process knows it by its decided manifest
    threading.Timer(0.3, gate.set).start()
    assert verify_checkpoint(out).content_hash == manifest.content_hash  # waited for the files
    assert pending.pending_manifest(out) is None and (out / "_manifest.json").is_file()


def test_a_failed_background_write_leaves_nothing_and_is_raised(tiny_tokenizer, tmp_path, in_background, monkeypatch):
    model = build_model("llama", tiny_tokenizer)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(handoff, "write_manifest", full)
    out = tmp_path / "policy"
    handoff.hand_over(model, tiny_tokenizer, out, max_shard_size="5GB", manifest_fields=FIELDS)
    with pytest.raises(ArtifactError, match="policy"):
        background.wait_for_background()
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no staging directory left
    assert pending.pending_manifest(out) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_policy_on_a_gpu_is_handed_over_without_leaving_it(name, tiny_tokenizer, tmp_path, in_background):
    """A bf16 policy on the GPU (optimize's ZeRO 0-2 module): its checkpoint is the bytes
    `save_pretrained` writes of it (snapshotted through page-locked memory), twice (the second from
    the kept form, the first snapshot's pinned blocks reused), and the copy handed over is an fp32
    model on the same GPU, buffers included, equal to loading the checkpoint there."""
    tok = copy.deepcopy(tiny_tokenizer)
    model = build_model(name, tok).to("cuda", torch.bfloat16)
    for n in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        manifest, handed = handoff.hand_over(model, tok, tmp_path / f"handed{n}", max_shard_size="5GB",
                                             manifest_fields=FIELDS)
        background.wait_for_background()
        saved = save_pretrained(model, tok, tmp_path / f"saved{n}")
        assert _files(tmp_path / f"handed{n}") == _files(saved)
        assert manifest.content_hash == commit_directory(saved, **FIELDS).content_hash
        assert {t.device.type for t in [*handed.parameters(), *handed.buffers()]} == {"cuda"}
        assert {p.dtype for p in handed.parameters()} == {torch.float32}
        loaded = load_checkpoint(tmp_path / f"handed{n}")[0].to("cuda")
        want, got = loaded.state_dict(), handed.state_dict()
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), name
        ids = torch.tensor([[1, 5, 9, 3, 7]], device="cuda")
        with torch.no_grad():
            assert torch.equal(handed(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_optimize_waits_for_saves_of_live_tensors_but_not_the_last_snapshot(in_background):
    """`wait_for_background(detached_in_flight=1)` (what optimize waits for): the last detached
    save (a policy written from its snapshot) goes on; a save of live tensors, or a second
    detached one, is waited for; saves finish in order, so a detached save behind another waits
    for it."""
    gates = [threading.Event() for _ in range(3)]
    done: list[int] = []

    def save(i):
        return lambda: (gates[i].wait(30), done.append(i))

    background.in_background(save(0), "snapshot 0", detached=True)
    assert background.wait_for_background(detached_in_flight=1) < 1 and done == []  # not waited for
    background.in_background(save(1), "snapshot 1", detached=True)
    threading.Timer(0.2, gates[0].set).start()
    background.wait_for_background(detached_in_flight=1)  # the first of two: waited for
    assert done == [0] and len(background.BACKGROUND.pending) == 1
    background.in_background(save(2), "train state", detached=False)
    threading.Timer(0.2, gates[1].set).start()
    threading.Timer(0.4, gates[2].set).start()
    background.wait_for_background(detached_in_flight=1)  # live tensors last: everything
    assert done == [0, 1, 2] and background.BACKGROUND.pending == [] and background.BACKGROUND.detached == set()
