"""The transformers rollout engine on one CUDA GPU (run with `-m gpu`; skipped without a GPU).

The engine runs fp32 on the GPU (TF32 matmuls stay off, PyTorch's default), so its log-probs are
a CPU teacher-forced pass's to float rounding (the 1e-4 of check_rollouts: ~1e-6 expected from a
few dozen fp32 reductions of a 2-layer model), greedy decoding picks the CPU's tokens, and a
resident worker's in-place weight copy happens on the device.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlpipe.schemas import read_manifest, read_table_artifact
from rlpipe.stages.common import models
from rlpipe.stages.rollout.config import RolloutConfig
from rlpipe.stages.rollout.run import run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


@pytest.fixture(autouse=True)
def _fresh_models(fresh_process_state):
    """Models cached or slotted on the GPU must not leak into CPU checks (or other tests)."""


def _config(policy, prompts, out, **kw) -> RolloutConfig:
    # fp32 on the GPU too (model.dtype's 'auto' would be bf16 there): the same math as the CPU's
    return RolloutConfig(checkpoint=policy, prompts=prompts, output=out, device="cuda", dtype="fp32", **kw)


def test_sampling_on_cuda_passes_every_rollout_check(tiny_policy_dir, prompts_dir, tmp_path, rollout_check):
    cfg = _config(tiny_policy_dir, prompts_dir, tmp_path / "r", batch_size=5, groups_per_shard=5, group_size=6,
                  max_new_tokens=24, temperature=1.0, stop=("5", "Q"), stop_token_ids=(40, 41))
    run(cfg)
    assert models.MODELS.slots["rollout"].model.device.type == "cuda"
    models.clear_cache()  # the check's teacher-forced pass runs on CPU
    counts = rollout_check(cfg.output, tiny_policy_dir, group_size=6, max_new_tokens=24, stop=cfg.stop,
                           stop_token_ids=cfg.stop_token_ids)
    assert sum(counts.values()) == 12 * 6


def test_greedy_on_cuda_equals_greedy_on_cpu(tiny_policy_dir, prompts_dir, tmp_path):
    rows = {}
    for device in ("cpu", "cuda"):
        models.clear_cache()
        cfg = _config(tiny_policy_dir, prompts_dir, tmp_path / device, temperature=0.0, group_size=2,
                      max_new_tokens=12, batch_size=4).model_copy(update={"device": device})
        run(cfg)
        rows[device] = read_table_artifact(cfg.output).to_pylist()
    assert [r["response_token_ids"] for r in rows["cuda"]] == [r["response_token_ids"] for r in rows["cpu"]]
    for cpu, cuda in zip(rows["cpu"], rows["cuda"], strict=True):
        np.testing.assert_allclose(cuda["response_logprobs"], cpu["response_logprobs"], atol=1e-4, rtol=0)


def test_in_place_load_on_cuda_equals_a_fresh_engine(tiny_tokenizer, prompts_dir, tmp_path):
    from rlpipe.stages.common.tiny import build_model, save_pretrained

    a, b = (save_pretrained(build_model(tiny_tokenizer, "causal", size="tiny", seed=s), tiny_tokenizer,
                            tmp_path / name) for name, s in (("a", 0), ("b", 1)))
    knobs = dict(group_size=4, max_new_tokens=10, temperature=1.0, seed=3)
    run(_config(a, prompts_dir, tmp_path / "on_a", **knobs))
    model = models.MODELS.slots["rollout"].model
    run(_config(b, prompts_dir, tmp_path / "in_place", **knobs))
    assert read_manifest(tmp_path / "in_place").extra["timing"]["model_load"] == "in_place"
    assert models.MODELS.slots["rollout"].model is model and model.device.type == "cuda"
    models.clear_cache()
    run(_config(b, prompts_dir, tmp_path / "fresh", **knobs))
    assert read_manifest(tmp_path / "fresh").extra["timing"]["model_load"] == "loaded"
    # the same weights in the same kind of module on the same device: the same samples, bit for bit
    got, want = (read_table_artifact(tmp_path / n).to_pylist() for n in ("in_place", "fresh"))
    assert [(r["response_token_ids"], r["response_logprobs"]) for r in got] == \
           [(r["response_token_ids"], r["response_logprobs"]) for r in want]
    assert read_manifest(tmp_path / "in_place").content_hash == read_manifest(tmp_path / "fresh").content_hash
