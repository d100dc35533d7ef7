"""Off-policy correction against the rollout engine's log-probs: truncated importance sampling
(w_t = min(exp(old_t - rollout_t), C)) and sequence masking on the mean |old_t - rollout_t|.

Golden values are computed by hand in the comments from a hand-made batch.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlpipe.stages.optimize.config import PPOClipLoss
from rlpipe.stages.optimize.core import PolicyObjective, off_policy_weights, policy_micro_loss

LN2, LN4 = math.log(2.0), math.log(4.0)


def _batch():
    """Two responses, 3 and 2 tokens. old - rollout = [0, ln2, -ln2] and [ln4, 0] (ratios
    1, 2, 1/2 and 4, 1); logp = old + ln 1.1 (rho = 1.1 inside the clip); A = +1 and -1."""
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    rollout = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.5, 0.0]], dtype=torch.float64)
    old = (rollout + torch.tensor([[0.0, LN2, -LN2], [LN4, 0.0, 0.0]], dtype=torch.float64)) * mask
    logp = ((old + math.log(1.1)) * mask).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]], dtype=torch.float64)
    return logp, old, rollout, adv, mask


def _loss(tis_cap=None, mismatch_mask=None, rollout=None, old=None):
    logp, old_, rollout_, adv, mask = _batch()
    old = old_ if old is None else old
    obj = PolicyObjective(loss=PPOClipLoss(), tis_cap=tis_cap, mismatch_mask=mismatch_mask)
    loss, stats = policy_micro_loss(obj, logp, old, adv, mask, token_count=5.0, seq_count=2.0, max_len=None,
                                    rollout_logp=rollout_ if rollout is None else rollout)
    return logp, loss, stats


def test_truncated_importance_sampling_golden():
    # C = 3: w = [1, 2, 0.5] and [min(4, 3) = 3, 1]; one token of five clipped.
    # l_t = -1.1 A_t w_t: row 0 -1.1 * (1 + 2 + 0.5) = -3.85, row 1 +1.1 * (3 + 1) = 4.4;
    # token-mean over N = 5: 0.55 / 5 = 0.11.
    logp, loss, stats = _loss(tis_cap=3.0)
    assert float(loss.detach()) == pytest.approx(0.11, abs=1e-12)
    assert float(stats["tis_weight_mean"]) == pytest.approx((1 + 2 + 0.5 + 3 + 1) / 5, abs=1e-12)
    assert float(stats["tis_clip_fraction"]) == pytest.approx(1 / 5, abs=1e-12)
    assert float(stats["mismatch_masked_fraction"]) == 0.0
    # the weight is detached: d l / d logp_t = -A_t rho_t w_t / N, e.g. row 0 token 1: -1.1 * 2 / 5
    loss.backward()
    expected = torch.tensor([[-1.1, -2.2, -0.55], [3.3, 1.1, 0.0]], dtype=torch.float64) / 5
    torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=1e-12)


def test_sequence_masking_golden():
    # mean |old - rollout|: row 0 (0 + ln2 + ln2) / 3 = 0.462, row 1 (ln4 + 0) / 2 = 0.693.
    # threshold 0.5 drops row 1: the loss is row 0's alone, -3.85 / 5 = -0.77 (N stays 5).
    _, loss, stats = _loss(tis_cap=3.0, mismatch_mask=0.5)
    assert float(loss) == pytest.approx(-0.77, abs=1e-12)
    assert float(stats["mismatch_masked_fraction"]) == pytest.approx(1 / 2, abs=1e-12)
    assert float(stats["tis_weight_mean"]) == pytest.approx((1 + 2 + 0.5) / 5, abs=1e-12)
    # masking alone: row 0 unweighted, -1.1 * 3 / 5 = -0.66; a threshold above both keeps both
    assert float(_loss(mismatch_mask=0.5)[1]) == pytest.approx(-0.66, abs=1e-12)
    assert float(_loss(mismatch_mask=0.7)[2]["mismatch_masked_fraction"]) == 0.0


def test_no_mismatch_and_no_cap_is_plain_ppo():
    logp, old, _, adv, mask = _batch()
    plain, plain_stats = policy_micro_loss(PolicyObjective(), logp, old, adv, mask, token_count=5.0, seq_count=2.0,
                                           max_len=None)
    # C = inf, no masking, and the engine agreeing with the trainer (rollout = old): w_t = 1 exactly
    _, corrected, stats = _loss(tis_cap=math.inf, rollout=old, old=old)
    assert torch.equal(corrected, plain)
    assert float(stats["tis_clip_fraction"]) == 0.0
    # C = inf with the mismatch: the untruncated weights, 1.1 * (-(1 + 2 + 0.5) + (4 + 1)) / 5 = 0.33
    assert float(_loss(tis_cap=math.inf)[1]) == pytest.approx(1.1 * 1.5 / 5, abs=1e-12)
    assert float(plain) == pytest.approx(1.1 * (-3 + 2) / 5, abs=1e-12)


def test_off_policy_weights_zero_on_padding_and_empty_rows():
    mask = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    old = torch.tensor([[0.5, 9.0], [9.0, 9.0]])
    weight, clipped, masked = off_policy_weights(old, torch.zeros_like(old), mask, tis_cap=1.2, mismatch_mask=0.1)
    # row 0: gap 0.5 > 0.1, masked; row 1 has no tokens: never counted as masked
    assert masked.tolist() == [1.0, 0.0]
    assert weight.abs().sum() == 0 and clipped.tolist() == [[1.0, 0.0], [0.0, 0.0]]


def test_config_needs_recomputed_old_logprobs(tmp_path):
    from rlpipe.stages.optimize.config import OptimizeConfig

    base = dict(policy=tmp_path / "p", rollouts=tmp_path / "r", advantages=tmp_path / "a", output=tmp_path / "o",
                metrics_output=tmp_path / "m")
    for knob in ({"tis_cap": 2.0}, {"mismatch_mask": 0.5}):
        with pytest.raises(ValueError, match="need recompute_old_logprobs"):
            OptimizeConfig(**base, **knob, recompute_old_logprobs=False)


def _between(values: list[float]) -> float:
    """A cut between the two middle values (far from both, so float noise cannot flip a side)."""
    v = sorted(values)
    return (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


@pytest.mark.integration
def test_stage_logs_the_correction(tmp_path, artifacts, tiny_policy_dir, make_config, read_metrics):
    """The stage feeds the rollouts' log-probs in: the masked and clipped fractions it logs are the
    ones computed here from the trainer's log-probs of the input policy (an independent forward)."""
    from rlpipe.schemas import read_table_artifact
    from rlpipe.stages.common.forward import teacher_forced_logprobs
    from rlpipe.stages.common.models import load_model
    from rlpipe.stages.optimize.run import run

    ro = read_table_artifact(artifacts["rollouts"], "rollouts").to_pydict()
    model, tok = load_model(tiny_policy_dir)
    trainer = teacher_forced_logprobs(model, ro["prompt_token_ids"], ro["response_token_ids"], tok.pad_token_id)
    diffs = [np.asarray(t, dtype=np.float64) - np.asarray(r, dtype=np.float64)
             for t, r in zip(trainer, ro["response_logprobs"], strict=True)]
    gaps = [float(np.abs(d).mean()) for d in diffs]
    ratios = np.exp(np.concatenate(diffs))
    threshold, cap = _between(gaps), _between(ratios.tolist())
    cfg = make_config(tmp_path, artifacts, tiny_policy_dir, "tis", tis_cap=cap, mismatch_mask=threshold,
                      micro_batch_size=16)
    run(cfg)
    step = read_metrics(cfg.metrics_output)[1]
    assert step["mismatch_masked_fraction"] == pytest.approx(np.mean([g > threshold for g in gaps]), abs=1e-9)
    assert step["tis_clip_fraction"] == pytest.approx(np.mean(ratios > cap), abs=1e-9)
    assert 0.3 < step["mismatch_masked_fraction"] < 0.7 and 0.3 < step["tis_clip_fraction"] < 0.7
