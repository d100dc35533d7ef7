"""Golden and invariance tests of the pure policy / value losses and the aggregation modes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlpipe.schemas.config_files import ConfigError, load_config, union_tags
from rlpipe.stages.optimize.config import (
    CustomLoss,
    GSPOLoss,
    LossConfig,
    OptimizeConfig,
    PPOClipLoss,
)
from rlpipe.stages.optimize.core import PolicyObjective, policy_micro_loss, step_slices
from rlpipe.stages.optimize.losses import (
    POLICY_LOSSES,
    agg_loss,
    clipped_value_loss,
    explained_variance,
    gspo,
    policy_loss,
    ppo_clip,
    register_policy_loss,
    value_moments,
)

PPO = PPOClipLoss().knobs()  # eps_low 0.2, eps_high 0.2, no dual clip


def close(x: torch.Tensor, expected) -> None:
    torch.testing.assert_close(x.detach().double(), torch.tensor(expected, dtype=torch.float64))


def _one(rho: float, adv: float, **knobs):
    logp = torch.tensor([[math.log(rho)]], dtype=torch.float64)
    old = torch.zeros_like(logp)
    return ppo_clip(logp, old, torch.tensor([[adv]], dtype=torch.float64), torch.ones_like(logp), **{**PPO, **knobs})


def test_ppo_clip_golden_example():
    # rho = 1.35, eps = 0.2, A = 0.2 -> unclipped 0.27, clipped 1.2 * 0.2 = 0.24, min 0.24, loss -0.24
    out = _one(1.35, 0.2, eps_low=0.2, eps_high=0.2)
    assert out.loss_mat.item() == pytest.approx(-0.24, abs=1e-12)
    assert out.clipped.item() == 1.0
    assert out.ratio.item() == pytest.approx(1.35)
    # the same token with a clip range wide enough (1 + 0.4 > 1.35): the unclipped -0.27, not clipped
    out = _one(1.35, 0.2, eps_low=0.2, eps_high=0.4)
    assert out.loss_mat.item() == pytest.approx(-0.27, abs=1e-12)
    assert out.clipped.item() == 0.0


def test_ppo_clip_unclipped_inside_trust_region_and_negative_advantage():
    assert _one(1.1, 0.5).loss_mat.item() == pytest.approx(-0.55)
    assert _one(1.1, 0.5).clipped.item() == 0.0
    # A < 0 and rho below 1 - eps: -min(0.7 * -0.5, 0.8 * -0.5) = 0.4 (clipped branch)
    out = _one(0.7, -0.5)
    assert out.loss_mat.item() == pytest.approx(0.4)
    assert out.clipped.item() == 1.0
    # A < 0 and rho above 1 + eps: unclipped is the max: 1.5 * 0.5 = 0.75, not clipped
    out = _one(1.5, -0.5)
    assert out.loss_mat.item() == pytest.approx(0.75)
    assert out.clipped.item() == 0.0


def test_clip_higher_golden():
    # eps_low 0.2, eps_high 0.28 (DAPO): rho 1.35, A 0.2 -> min(0.27, 1.28 * 0.2 = 0.256) -> loss -0.256
    assert _one(1.35, 0.2, eps_low=0.2, eps_high=0.28).loss_mat.item() == pytest.approx(-0.256)
    # the low side is unchanged: rho 0.7, A -0.5 -> 0.8 * 0.5 = 0.4
    assert _one(0.7, -0.5, eps_low=0.2, eps_high=0.28).loss_mat.item() == pytest.approx(0.4)
    # rho 1.25 is inside [0.8, 1.28]: unclipped -0.25
    assert _one(1.25, 0.2 / 0.2 * 0.2, eps_low=0.2, eps_high=0.28).loss_mat.item() == pytest.approx(-0.25)


def test_dual_clip_golden():
    # rho 5, A -1: ppo loss = max(5, 1.2) = 5; dual clip c = 3 bounds it: min(5, 3) = 3
    out = _one(5.0, -1.0, dual_clip=3.0)
    assert out.loss_mat.item() == pytest.approx(3.0)
    assert out.dual_clipped.item() == 1.0
    assert _one(5.0, -1.0).loss_mat.item() == pytest.approx(5.0)
    # rho 2 < c: no dual clip (loss 2)
    assert _one(2.0, -1.0, dual_clip=3.0).loss_mat.item() == pytest.approx(2.0)
    # A > 0: dual clip never applies (rho 5, A 1 -> -min(5, 1.2) = -1.2)
    assert _one(5.0, 1.0, dual_clip=3.0).loss_mat.item() == pytest.approx(-1.2)
    with pytest.raises(ValueError, match="dual_clip"):
        _one(1.0, 1.0, dual_clip=1.0)


def test_ratio_is_exactly_one_and_nothing_clipped_when_logp_equals_old():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 5, generator=g) - 3
    adv = torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    for loss in (PPOClipLoss(), GSPOLoss()):
        out = policy_loss(loss, logp, logp.clone(), adv, mask)
        assert torch.equal(out.ratio, mask)
        assert out.clipped.sum().item() == 0.0
        assert torch.equal(out.loss_mat, -adv * mask)


def test_gspo_uses_the_per_sequence_mean_log_ratio_for_every_token():
    # Two responses of 3 and 1 tokens (padding holds garbage that must not count), log-ratios
    # logp - old: [0.1, 0.3, 0.5] and [-0.2]. GSPO: s_i = exp(mean over response i's tokens):
    #   s_0 = exp(0.9 / 3) = exp(0.3) = 1.3498588, s_1 = exp(-0.2 / 1) = 0.8187308.
    # A batch-wide mean would give exp(0.7 / 4) = exp(0.175) to both; a per-sequence sum exp(0.9),
    # exp(-0.2); the token ratios exp(0.1), exp(0.3), exp(0.5): none of them matches.
    logp = torch.tensor([[-1.0, -2.0, -0.5, 7.0], [-0.7, 5.0, 5.0, 5.0]], dtype=torch.float64)
    old = torch.tensor([[-1.1, -2.3, -1.0, -4.0], [-0.5, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([[1.0] * 4, [-1.0] * 4], dtype=torch.float64)
    s0, s1 = 1.3498588075760032, 0.8187307530779818  # exp(0.3), exp(-0.2)
    out = gspo(logp, old, adv, mask, eps_low=0.5, eps_high=0.5)  # [0.5, 1.5] holds both: unclipped
    close(out.ratio, [[s0, s0, s0, 0.0], [s1, 0.0, 0.0, 0.0]])
    close(out.loss_mat, [[-s0, -s0, -s0, 0.0], [s1, 0.0, 0.0, 0.0]])  # l = -s_i A
    assert out.clipped.sum().item() == 0.0
    # GSPO's own clip range (3e-4 / 4e-4): s_0 > 1 + 4e-4 with A > 0 -> -(1 + 4e-4);
    # s_1 < 1 - 3e-4 with A < 0 -> max(-s_1 A, -(1 - 3e-4) A) = 1 - 3e-4; every token clipped.
    out = policy_loss(GSPOLoss(), logp, old, adv, mask)
    close(out.loss_mat, [[-(1 + 4e-4)] * 3 + [0.0], [1 - 3e-4, 0.0, 0.0, 0.0]])
    assert out.clipped.tolist() == mask.tolist()


def test_gspo_gradient_is_the_mean_token_gradient():
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = gspo(logp, logp.detach().clone(), torch.ones(1, 3), mask, eps_low=0.2, eps_high=0.2)
    agg_loss(out.loss_mat, mask, "token-mean").backward()
    # loss = -s * A averaged over 2 tokens, ds/dlogp_t = s / |y| = 1/2 on valid tokens
    close(logp.grad, [[-0.5, -0.5, 0.0]])


def test_registry_rejects_a_second_registration():
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss(PPOClipLoss)(ppo_clip)


def test_config_union_and_registry_name_the_same_losses():
    # One list of names: each tag of the config union is registered with that very variant class.
    tags = union_tags(LossConfig)
    assert set(tags) == set(POLICY_LOSSES) == {"ppo_clip", "gspo", "trpo", "custom"}
    assert all(POLICY_LOSSES[name][0] is cls for name, cls in tags.items())


def test_each_loss_has_its_own_clip_defaults_and_errors_name_the_key():
    base = ["policy=p", "rollouts=r", "advantages=a", "output=o", "metrics_output=m"]
    assert load_config(OptimizeConfig, None, base).loss == PPOClipLoss(eps_low=0.2, eps_high=0.2, dual_clip=None)
    # `loss=gspo` takes GSPO's clip range (Zheng et al. 2025: 3e-4 / 4e-4), not PPO's 0.2
    assert load_config(OptimizeConfig, None, [*base, "loss=gspo"]).loss == GSPOLoss(eps_low=3e-4, eps_high=4e-4)
    cfg = load_config(OptimizeConfig, None, [*base, "loss.name=ppo_clip", "loss.eps_high=0.28"])
    assert cfg.loss.knobs() == {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": None}
    with pytest.raises(ConfigError, match="unknown key 'loss.dual_clip'; allowed keys: eps_high, eps_low, name"):
        load_config(OptimizeConfig, None, [*base, "loss=gspo", "loss.dual_clip=3"])
    with pytest.raises(ConfigError, match="key 'loss.dual_clip': Input should be greater than 1"):
        load_config(OptimizeConfig, None, [*base, "loss.dual_clip=0.5"])


@pytest.fixture
def user_losses(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # user_losses.py


def test_custom_loss_by_import_path(user_losses):
    logp = torch.tensor([[-1.0, -2.0, 9.0], [-0.5, 9.0, 9.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.5, -2.0, 0.0], [-0.5, 0.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float64)
    loss = CustomLoss(function="user_losses:reinforce", kwargs={"scale": 0.5})
    out = policy_loss(loss, logp, old, adv, mask)
    # l_t = -0.5 A_t logp_t on real tokens: [0.5, 1.0] and [-0.5]; the logged ratio is rho_t
    close(out.loss_mat, [[0.5, 1.0, 0.0], [-0.5, 0.0, 0.0]])
    close(out.ratio, [[math.exp(0.5), 1.0, 0.0], [1.0, 0.0, 0.0]])
    agg_loss(out.loss_mat, mask, "token-mean").backward()  # d/dlogp_t of -0.5 A_t logp_t / 3 tokens
    close(logp.grad, [[-0.5 / 3, -0.5 / 3, 0.0], [1.0 / 3, 0.0, 0.0]])


@pytest.mark.parametrize("function,error", [
    ("user_losses:per_sequence", r"loss.function 'user_losses:per_sequence' returned shape \(2,\); expected the per-token loss, a tensor of shape \(2, 3\)"),
    ("user_losses:not_a_tensor", r"'user_losses:not_a_tensor' returned float"),
    ("user_losses:detached", r"'user_losses:detached' returned a loss with no gradient w.r.t. logp"),
    ("user_losses:nope", r"loss.function: cannot import 'user_losses:nope': AttributeError"),
])
def test_custom_loss_errors_name_the_import_path(user_losses, function, error):
    logp = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match=error):
        policy_loss(CustomLoss(function=function), logp, torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3))


L = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0], [5.0, 6.0, 100.0, 100.0]])
M = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.float32)


@pytest.mark.parametrize(
    "mode,expected",
    [
        # (1+2+3+4+5+6) / 6 tokens
        ("token-mean", 21 / 6),
        # 1+2+3+4+5+6: the padded 100s never count
        ("token-sum", 21.0),
        # mean(6/3, 4/1, 11/2) = (2 + 4 + 5.5) / 3
        ("seq-mean-token-mean", (2 + 4 + 5.5) / 3),
        # mean(6, 4, 11)
        ("seq-mean-token-sum", 21 / 3),
        # mean(6/8, 4/8, 11/8) with max_len 8
        ("seq-mean-token-sum-norm", 21 / 8 / 3),
    ],
)
def test_agg_modes_hand_computed(mode, expected):
    assert agg_loss(L, M, mode, max_len=8).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
def test_agg_micro_batches_with_global_counts_sum_to_the_whole(mode):
    g = torch.Generator().manual_seed(1)
    loss = torch.randn(8, 6, generator=g)
    mask = (torch.rand(8, 6, generator=g) > 0.3).float()
    mask[:, 0] = 1
    whole = agg_loss(loss, mask, mode, max_len=6)
    n, s = mask.sum(), (mask.sum(-1) > 0).sum()
    parts = sum(agg_loss(loss[i:i + 2], mask[i:i + 2], mode, global_token_count=n, global_seq_count=s, max_len=6)
                for i in range(0, 8, 2))
    assert parts.item() == pytest.approx(whole.item(), abs=1e-6)
    # without the global counts the micro-batch means do not add up (the bug the counts prevent)
    if mode == "token-mean":
        local = sum(agg_loss(loss[i:i + 2], mask[i:i + 2], mode) for i in range(0, 8, 2)) / 4
        assert local.item() != pytest.approx(whole.item(), abs=1e-6)


def test_agg_modes_are_the_configs():
    from typing import get_args

    from rlpipe.stages.optimize.losses import AGG_MODES, AggMode

    assert AGG_MODES == get_args(AggMode) == get_args(OptimizeConfig.model_fields["agg_mode"].annotation)


def test_agg_unknown_mode():
    with pytest.raises(ValueError, match="unknown aggregation mode"):
        agg_loss(L, M, "sum")


def test_clipped_value_loss_golden():
    old = torch.tensor([[1.0, 1.0, 1.0]])
    v = torch.tensor([[1.5, 1.1, 0.0]])
    r = torch.tensor([[2.0, 0.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = clipped_value_loss(v, old, r, mask, clip_eps=0.2)
    # token 0: unclipped (1.5-2)^2 = 0.25; clipped V = 1.2 -> (1.2-2)^2 = 0.64; 0.5 * max = 0.32
    # token 1: unclipped 1.21; clipped V = 1.1 (inside) -> 1.21; 0.5 * 1.21 = 0.605
    close(out.loss_mat, [[0.32, 0.605, 0.0]])
    assert out.clipped.tolist() == [[1.0, 0.0, 0.0]]
    close(clipped_value_loss(v, old, r, mask, clip_eps=None).loss_mat, [[0.125, 0.605, 0.0]])


def test_explained_variance():
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(value_moments(r, r, mask)) == pytest.approx(1.0)
    assert explained_variance(value_moments(torch.zeros_like(r), r, mask)) == pytest.approx(0.0)
    # V = R + const: residual variance 0 -> 1
    assert explained_variance(value_moments(r + 3, r, mask)) == pytest.approx(1.0)
    # V = 2.5 - (R - 2.5): residual 2(R - 2.5), var 4 var(R) -> 1 - 4 = -3
    assert explained_variance(value_moments(5 - r, r, mask)) == pytest.approx(-3.0)
    # moments add over micro-batches
    a, b = value_moments(r[:, :2] * 0, r[:, :2], mask[:, :2]), value_moments(r[:, 2:] * 0, r[:, 2:], mask[:, 2:])
    assert explained_variance(a + b) == pytest.approx(0.0)


def test_policy_micro_loss_kl_and_entropy_terms():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = logp.detach().clone()
    ref = torch.tensor([[-1.5, -2.0]])
    adv = torch.tensor([[1.0, 1.0]])
    mask = torch.ones(1, 2)
    ent = torch.tensor([[0.5, 1.5]])
    obj = PolicyObjective(kl_beta=0.1, kl_estimator="k1", entropy_coef=0.01)
    loss, stats = policy_micro_loss(obj, logp, old, adv, mask, token_count=2, seq_count=1, max_len=2,
                                    ref_logp=ref, entropy=ent)
    # policy -1; k1 mean = (0.5 + 0) / 2 = 0.25; H mean = 1.0 -> -1 + 0.1 * 0.25 - 0.01 * 1.0
    assert loss.item() == pytest.approx(-1 + 0.025 - 0.01)
    assert stats["kl_ref"].item() == pytest.approx(0.25)
    assert stats["entropy"].item() == pytest.approx(1.0)
    assert stats["approx_kl"].item() == 0.0 and stats["clip_fraction"].item() == 0.0
    with pytest.raises(ValueError, match="reference"):
        policy_micro_loss(obj, logp, old, adv, mask, token_count=2, seq_count=1, max_len=2)


def test_step_slices_partition_each_minibatch_across_ranks():
    order = list(range(16))
    import numpy as np

    order = np.array(order)[::-1]
    one = step_slices(order, 8, 1, 0, 2)
    r0, r1 = step_slices(order, 8, 2, 0, 2), step_slices(order, 8, 2, 1, 2)
    assert len(one) == len(r0) == 2 and len(one[0]) == 4 and len(r0[0]) == 2
    for k in range(2):
        whole = np.concatenate(one[k])
        assert sorted(whole) == sorted(np.concatenate(r0[k] + r1[k]))
        assert not set(np.concatenate(r0[k])) & set(np.concatenate(r1[k]))
    with pytest.raises(ValueError, match="minibatch_size"):
        step_slices(order, 8, 3, 0, 1)


def test_grouping_by_length_keeps_each_steps_rows_and_cuts_padding():
    """Ordered by length inside a rank's block: the same rows per step and rank, and a padded
    micro-batch no longer than the shuffled cut's (here: 4 rows of 3..60 tokens per micro-batch)."""
    import numpy as np

    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 60, size=32)
    order = rng.permutation(32)
    for world, rank in ((1, 0), (2, 0), (2, 1)):
        plain = step_slices(order, 16, world, rank, 4)
        grouped = step_slices(order, 16, world, rank, 4, lengths)
        for p, g in zip(plain, grouped, strict=True):
            assert sorted(np.concatenate(p)) == sorted(np.concatenate(g))  # the step's rows on this rank
            flat = np.concatenate(g)
            assert list(lengths[flat]) == sorted(lengths[flat])
        padded = {name: sum(len(m) * int(lengths[m].max()) for step in s for m in step)
                  for name, s in (("plain", plain), ("grouped", grouped))}
        assert padded["grouped"] < padded["plain"], padded
