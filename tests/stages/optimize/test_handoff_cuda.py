"""The policy optimize hands to the next stage of its process on one CUDA GPU (run with `-m gpu`;
skipped without a GPU): in bf16 at ZeRO 0 (the engine's module, snapshotted through page-locked
memory) and ZeRO 3 (gathered module by module onto the GPU, and that copy itself handed over:
`full_parameters(..., device=)`, `hand_over(disposable=True)`), the copy is a bf16 model on the GPU
whose every tensor equals the checkpoint written in the background, loaded onto the GPU."""

from __future__ import annotations

import pytest
import torch

from rlpipe.stages.common import background, models
from rlpipe.stages.optimize.run import run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_the_policy_handed_over_on_a_gpu_is_its_checkpoint(tmp_path, artifacts, tiny_policy_dir, make_config,
                                                           fresh_process_state, zero_stage):
    from rlpipe.stages.common.tiny import load_checkpoint

    background.allow_background()  # (as the local runner: the policy goes to the next stage in memory)
    cfg = make_config(tmp_path, artifacts, tiny_policy_dir, f"z{zero_stage}", dtype="auto", zero_stage=zero_stage,
                      minibatch_size=16, micro_batch_size=4, lr=1e-3)
    manifest = run(cfg)
    handed, _ = next(v for k, v in models.MODELS.cache.items() if k[0] == manifest.content_hash)
    background.wait_for_background()
    assert {t.device.type for t in [*handed.parameters(), *handed.buffers()]} == {"cuda"}
    assert {p.dtype for p in handed.parameters()} == {torch.bfloat16}
    saved = load_checkpoint(cfg.output, "causal", torch.bfloat16)[0].to("cuda").state_dict()
    got = handed.state_dict()
    assert saved.keys() == got.keys() and all(torch.equal(saved[k], got[k]) for k in saved), zero_stage
