"""Advantage estimators: golden numbers, hand-computed GAE, loop-vs-vectorised, the registry."""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path
from typing import Literal

import pytest
import torch

from rlpipe.schemas.config import Variant
from rlpipe.schemas.config_files import ConfigError, parse_config, union_tags
from rlpipe.stages.advantage.config import (
    AdvantageConfig,
    CustomEstimator,
    EstimatorConfig,
    GAEEstimator,
    GRPOEstimator,
)
from rlpipe.stages.advantage.estimators import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    dr_grpo,
    gae,
    grpo,
    masked_whiten,
    register_estimator,
    reinforce_pp,
    reinforce_pp_baseline,
    remax,
    rloo,
)

R4 = torch.tensor([1.0, 0.8, 0.4, 0.2], dtype=torch.float64)
ONE_GROUP = torch.zeros(4, dtype=torch.long)


def estimator(name: str, **knobs) -> Variant:
    """The config variant registered under `name`, with `knobs` (the rest at their defaults)."""
    return ADVANTAGE_ESTIMATORS[name].config(**knobs)


# ---------------------------------------------------------------------------------------------
# Golden numbers
# ---------------------------------------------------------------------------------------------
def test_grpo_golden_population_std():
    # mean 0.6, population std sqrt((0.16 + 0.04 + 0.04 + 0.16) / 4) = 0.3162
    out = grpo(R4, ONE_GROUP, std="population", scale="group")
    torch.testing.assert_close(out.advantages, torch.tensor([1.265, 0.632, -0.632, -1.265], dtype=torch.float64),
                               atol=5e-4, rtol=0)
    assert not out.no_signal.any()


def test_grpo_golden_sample_std():
    # sample std sqrt(0.4 / 3) = 0.3651
    out = grpo(R4, ONE_GROUP, std="sample", scale="group")
    torch.testing.assert_close(out.advantages, torch.tensor([1.095, 0.548, -0.548, -1.095], dtype=torch.float64),
                               atol=5e-4, rtol=0)


def test_grpo_scales():
    r = torch.tensor([1.0, 0.0, 0.5, 0.3], dtype=torch.float64)
    g = torch.tensor([0, 0, 1, 1])
    # group means 0.5 and 0.4 -> centred [0.5, -0.5, 0.1, -0.1]
    centred = torch.tensor([0.5, -0.5, 0.1, -0.1], dtype=torch.float64)
    torch.testing.assert_close(grpo(r, g, std="sample", scale="none").advantages, centred)
    torch.testing.assert_close(dr_grpo(r, g).advantages, centred)
    # batch: divide by the population std of all four rewards
    batch_std = statistics.pstdev([1.0, 0.0, 0.5, 0.3])
    torch.testing.assert_close(grpo(r, g, scale="batch", std="population", eps=0.0).advantages, centred / batch_std)


def test_rloo_equals_leave_one_out_and_scaled_centering():
    r = torch.tensor([1.0, 0.8, 0.4, 0.2, 3.0, 1.0], dtype=torch.float64)
    g = torch.tensor([7, 7, 7, 7, 2, 2])
    out = rloo(r, g).advantages
    loo = [r[i] - (sum(r[j] for j in range(len(r)) if g[j] == g[i] and j != i) / (int((g == g[i]).sum()) - 1))
           for i in range(len(r))]
    torch.testing.assert_close(out, torch.stack(loo))
    # G / (G - 1) * (r - mean_g): 4/3 * [0.4, 0.2, -0.2, -0.4] and 2 * [1, -1]
    torch.testing.assert_close(out, torch.tensor([4 / 3 * 0.4, 4 / 3 * 0.2, -4 / 3 * 0.2, -4 / 3 * 0.4, 2.0, -2.0],
                                                 dtype=torch.float64))


# reinforce_pp (token returns) and remax (an outside baseline) have no group statistics: tested below.
@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS.keys() - {"gae", "custom", "reinforce_pp", "remax"}))
def test_zero_variance_and_singleton_groups_give_zero_and_are_flagged(name):
    # group 0: all equal (0.1 three times, whose float mean is not exactly 0.1); group 1: one
    # sample; group 2: a real signal.
    r = torch.tensor([0.1, 0.1, 0.1, 0.9, 0.2, 0.7], dtype=torch.float64)
    g = torch.tensor([0, 0, 0, 1, 2, 2])
    mask = torch.ones(6, 3, dtype=torch.float64)
    out = compute_advantages(estimator(name), AdvantageInputs(r, g, mask, torch.zeros(6, 3, dtype=torch.float64)))
    assert out.no_signal.tolist() == [True, True, True, True, False, False]
    if name == "reinforce_pp_baseline":
        # zero before whitening: the degenerate rows all get the same value -mu / sigma
        a = out.token_advantages
        assert torch.all(a[:4] == a[0, 0]) and a[5, 0] > a[0, 0] > a[4, 0]  # 0.7 > 0.45 > 0.2
    else:
        assert torch.all(out.token_advantages[:4] == 0) and torch.all(out.advantages[:4] == 0)
        assert torch.all(out.advantages[4:] != 0)


# ---------------------------------------------------------------------------------------------
# REINFORCE++ and ReMax by hand
# ---------------------------------------------------------------------------------------------
def test_reinforce_pp_hand_computed_discounted_and_whitened():
    # Row 0: 3 tokens, R = 1 on the last. Row 1: 2 tokens with token rewards 0.5, -1 (as KL in the
    # reward would give), then padding holding garbage (123) that must not leak.
    tr = torch.tensor([[0.0, 0.0, 1.0], [0.5, -1.0, 123.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    # gamma = 0.5, G_t = r_t + 0.5 G_{t+1}:
    #   row 0: G_2 = 1, G_1 = 0 + 0.5 * 1 = 0.5, G_0 = 0 + 0.5 * 0.5 = 0.25
    #   row 1: G_1 = -1, G_0 = 0.5 + 0.5 * (-1) = 0
    # Whitening over the 5 real tokens [0.25, 0.5, 1, 0, -1]: mu = 0.75 / 5 = 0.15;
    #   deviations [0.1, 0.35, 0.85, -0.15, -1.15], squares sum 0.01 + 0.1225 + 0.7225 + 0.0225
    #   + 1.3225 = 2.2, sample std sqrt(2.2 / 4) = sqrt(0.55) = 0.7416198.
    #   A = deviations / 0.7416198 = [0.134840, 0.471940, 1.146140, -0.202260, -1.550664]
    sd = math.sqrt(0.55)
    expected = torch.tensor([[0.1 / sd, 0.35 / sd, 0.85 / sd], [-0.15 / sd, -1.15 / sd, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(expected[0], torch.tensor([0.134840, 0.471940, 1.146140], dtype=torch.float64),
                               atol=1e-6, rtol=0)  # the rounded hand values above
    # eps = 0 (the config asks for > 0; the math function takes any) makes the whitening exact.
    torch.testing.assert_close(reinforce_pp(tr, mask, gamma=0.5, eps=0.0), expected, atol=1e-12, rtol=0)
    # gamma = 1: every token of a response carries the sum of the rewards from it on (row 1: -0.5, -1)
    cfg = estimator("reinforce_pp", gamma=1.0)
    out = compute_advantages(cfg, AdvantageInputs(torch.zeros(2), torch.arange(2), mask, tr))
    g1 = [1.0, 1.0, 1.0, -0.5, -1.0]
    mu, sd1 = statistics.mean(g1), statistics.stdev(g1)
    torch.testing.assert_close(out.token_advantages[mask.bool()],
                               torch.tensor([(x - mu) / (sd1 + cfg.eps) for x in g1], dtype=torch.float64))
    assert out.advantages is None and out.returns is None and not out.no_signal.any()


def test_remax_hand_computed_greedy_baseline():
    # Group 0 (greedy reward 0.5): rewards 1, 0 -> A = 0.5, -0.5.
    # Group 1 (greedy reward 1): rewards 1, 0.5 -> A = 0, -0.5 (a signal: the second sample is worse).
    # Group 2 (greedy reward 1): rewards 1, 1 -> A = 0, 0: no signal, flagged.
    # Group 3 (greedy reward 0, one sample): reward 1 -> A = 1 (a singleton still has a baseline).
    r = torch.tensor([1.0, 0.0, 1.0, 0.5, 1.0, 1.0, 1.0], dtype=torch.float64)
    g = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    b = torch.tensor([0.5, 0.5, 1.0, 1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    out = remax(r, b, g)
    torch.testing.assert_close(out.advantages, torch.tensor([0.5, -0.5, 0.0, -0.5, 0.0, 0.0, 1.0], dtype=torch.float64))
    assert out.no_signal.tolist() == [False, False, False, False, True, True, False]
    mask = torch.tensor([[1, 1]] * 6 + [[1, 0]], dtype=torch.float64)
    full = compute_advantages(estimator("remax"), AdvantageInputs(r, g, mask, torch.zeros(7, 2), baselines=b))
    torch.testing.assert_close(full.token_advantages, out.advantages.unsqueeze(-1) * mask)  # A_i on every token
    with pytest.raises(ValueError, match="needs the greedy response of every prompt.*greedy_baseline: true"):
        compute_advantages(estimator("remax"), AdvantageInputs(r, g, mask, torch.zeros(7, 2)))


# ---------------------------------------------------------------------------------------------
# GAE by hand on a 2 x 4 masked batch
# ---------------------------------------------------------------------------------------------
def test_gae_hand_computed_2x4_masked():
    gamma, lam = 0.9, 0.5  # gamma * lambda = 0.45
    # Row 0: 4 tokens. Row 1: 2 tokens, then padding holding garbage (9s, 7s) that must not leak.
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0], [-0.1, 0.5, 9.0, 9.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 0.4, 0.3, 0.2], [0.2, 0.6, 7.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float64)
    # Row 0, delta_t = r_t + 0.9 V_{t+1} - V_t, with V_4 = 0:
    #   delta_3 = 1 + 0 - 0.2 = 0.8; delta_2 = 0.9*0.2 - 0.3 = -0.12
    #   delta_1 = 0.9*0.3 - 0.4 = -0.13; delta_0 = 0.9*0.4 - 0.5 = -0.14
    # A_t = delta_t + 0.45 A_{t+1}:
    #   A_3 = 0.8; A_2 = -0.12 + 0.36 = 0.24; A_1 = -0.13 + 0.108 = -0.022
    #   A_0 = -0.14 - 0.0099 = -0.1499
    # R_t = A_t + V_t = [0.3501, 0.378, 0.54, 1.0]
    # Row 1 (V_2 = 0, not the padded 7): delta_1 = 0.5 - 0.6 = -0.1; delta_0 = -0.1 + 0.54 - 0.2 = 0.24
    #   A_1 = -0.1; A_0 = 0.24 - 0.045 = 0.195; R = [0.395, 0.5]
    adv, ret = gae(r, v, mask, gamma=gamma, lam=lam)
    expected_adv = torch.tensor([[-0.1499, -0.022, 0.24, 0.8], [0.195, -0.1, 0, 0]], dtype=torch.float64)
    expected_ret = torch.tensor([[0.3501, 0.378, 0.54, 1.0], [0.395, 0.5, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected_adv, atol=1e-12, rtol=0)
    torch.testing.assert_close(ret, expected_ret, atol=1e-12, rtol=0)

    # Whitening over the 6 real tokens only: mean mu = 0.9631 / 6 = 0.16051667, sample std (n - 1 = 5)
    # sd = sqrt((sum x^2 - 6 mu^2) / 5) = sqrt((0.76857901 - 0.15459360) / 5) = 0.35042414.
    real = [-0.1499, -0.022, 0.24, 0.8, 0.195, -0.1]
    mu, sd = 0.9631 / 6, math.sqrt((sum(x * x for x in real) - 0.9631 ** 2 / 6) / 5)
    # eps = 0 (the config asks for > 0; model_construct skips that) makes the whitening exact.
    cfg = GAEEstimator.model_construct(gamma=gamma, lam=lam, whiten=True, eps=0.0)
    out = compute_advantages(cfg, AdvantageInputs(torch.zeros(2), torch.arange(2), mask, r, v))
    expected_white = torch.tensor([[(x - mu) / sd for x in real[:4]], [(x - mu) / sd for x in real[4:]] + [0, 0]],
                                  dtype=torch.float64)
    torch.testing.assert_close(out.token_advantages, expected_white, atol=1e-12, rtol=0)
    # The output itself is whitened over the real tokens only: masked mean 0 and sample std 1. With
    # the 2 padded zeros counted it would not be; with the population std its std would be sqrt(6/5).
    white = out.token_advantages[mask.bool()]
    assert white.numel() == 6
    assert white.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert white.std(correction=1).item() == pytest.approx(1.0, abs=1e-12)
    torch.testing.assert_close(out.returns, expected_ret, atol=1e-12, rtol=0)


def test_padding_never_enters_whitening_or_gae():
    g = torch.tensor([0, 0, 1, 1, 1])
    r = torch.tensor([1.0, 0.0, 0.3, 0.9, 0.4], dtype=torch.float64)
    lengths = torch.tensor([3, 1, 5, 2, 4])
    mask = (torch.arange(5)[None] < lengths[:, None]).double()
    garbage = torch.randn(5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 100
    # masked_whiten: changing the padded entries of x changes nothing
    x = torch.randn(5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    x2 = torch.where(mask.bool(), x, garbage)
    torch.testing.assert_close(masked_whiten(x, mask), masked_whiten(x2, mask), atol=0, rtol=0)
    assert torch.all(masked_whiten(x2, mask)[mask == 0] == 0)
    # reinforce_pp_baseline: its whitening weighs every real token once (rows of 3, 1, 5, 2, 4 tokens)
    a, _ = reinforce_pp_baseline(r, g, mask, eps=0.0)
    tokens = [float(r[i] - r[g == g[i]].mean()) for i in range(5) for _ in range(int(lengths[i]))]
    mu, sd = statistics.mean(tokens), statistics.stdev(tokens)
    torch.testing.assert_close(a[:, 0], (r - torch.tensor([0.5, 0.5, 1.6 / 3, 1.6 / 3, 1.6 / 3],
                                                            dtype=torch.float64) - mu) / sd)
    # gae: garbage in padded rewards and values changes nothing
    v = torch.rand(5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    tr = torch.rand(5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    clean = gae(tr * mask, v * mask, mask, gamma=0.99, lam=0.9)
    dirty = gae(torch.where(mask.bool(), tr, garbage), torch.where(mask.bool(), v, -garbage), mask, gamma=0.99, lam=0.9)
    for c, d in zip(clean, dirty, strict=True):
        torch.testing.assert_close(c, d, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# Seeded loop-vs-vectorised equivalence for every registered estimator
# ---------------------------------------------------------------------------------------------
def _groups(g: list[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, gid in enumerate(g):
        out.setdefault(gid, []).append(i)
    return out


def _degenerate(members: list[float]) -> bool:
    return len(members) < 2 or max(members) == min(members)


def loop_grpo(r, g, lengths, tr, v, *, std, scale, eps):
    sd = statistics.stdev if std == "sample" else statistics.pstdev
    batch_sd = sd(r)
    groups = _groups(g)
    out = []
    for i in range(len(r)):
        m = [r[j] for j in groups[g[i]]]
        if _degenerate(m):
            out.append(0.0)
            continue
        denom = {"group": sd(m) + eps, "batch": batch_sd + eps, "none": 1.0}[scale]
        out.append((r[i] - statistics.mean(m)) / denom)
    return [[a] * n for a, n in zip(out, lengths, strict=True)]


def loop_dr_grpo(r, g, lengths, tr, v):
    groups = _groups(g)
    out = [0.0 if _degenerate(m := [r[j] for j in groups[g[i]]]) else r[i] - statistics.mean(m) for i in range(len(r))]
    return [[a] * n for a, n in zip(out, lengths, strict=True)]


def loop_rloo(r, g, lengths, tr, v):
    groups = _groups(g)
    out = []
    for i in range(len(r)):
        others = [r[j] for j in groups[g[i]] if j != i]
        out.append(0.0 if _degenerate(others + [r[i]]) else r[i] - sum(others) / len(others))
    return [[a] * n for a, n in zip(out, lengths, strict=True)]


def _whiten(rows: list[list[float]], eps: float) -> list[list[float]]:
    flat = [x for row in rows for x in row]
    mu, sd = statistics.mean(flat), statistics.stdev(flat)
    return [[(x - mu) / (sd + eps) for x in row] for row in rows]


def loop_reinforce_pp_baseline(r, g, lengths, tr, v, *, eps):
    centred = loop_dr_grpo(r, g, lengths, tr, v)
    return _whiten(centred, eps)


def loop_reinforce_pp(r, g, lengths, tr, v, *, gamma, eps):
    rows = []
    for b, n in enumerate(lengths):  # G_t = sum_{s >= t} gamma^(s - t) r_s, written as a plain sum
        rows.append([sum(gamma ** (s - t) * tr[b][s] for s in range(t, n)) for t in range(n)])
    return _whiten(rows, eps)


def loop_remax(r, g, lengths, tr, v, *, baselines):
    return [[r[i] - baselines[i]] * n for i, n in enumerate(lengths)]  # A_i = r_i - r_greedy


def loop_gae(r, g, lengths, tr, v, *, gamma, lam, whiten, eps):
    rows = []
    for b, n in enumerate(lengths):
        adv = [0.0] * n
        for t in range(n):
            total = 0.0
            for k in range(t, n):  # A_t = sum_l (gamma lam)^l delta_{t+l}, written as a plain sum
                v_next = v[b][k + 1] if k + 1 < n else 0.0
                total += (gamma * lam) ** (k - t) * (tr[b][k] + gamma * v_next - v[b][k])
            adv[t] = total
        rows.append(adv)
    return _whiten(rows, eps) if whiten else rows


LOOP_REFERENCES = {
    "grpo": loop_grpo,
    "dr_grpo": loop_dr_grpo,
    "rloo": loop_rloo,
    "reinforce_pp_baseline": loop_reinforce_pp_baseline,
    "reinforce_pp": loop_reinforce_pp,
    "remax": loop_remax,
    "gae": loop_gae,
}

KNOB_CASES = {
    "grpo": [dict(std=s, scale=c) for s in ("sample", "population") for c in ("group", "batch", "none")],
    "dr_grpo": [{}],
    "rloo": [{}],
    "reinforce_pp_baseline": [{}, dict(eps=1e-3)],
    "reinforce_pp": [{}, dict(gamma=0.9), dict(gamma=0.0, eps=1e-3)],
    "remax": [{}],
    "gae": [dict(gamma=1.0, lam=0.95), dict(gamma=0.9, lam=0.7, whiten=False), dict(gamma=0.99, lam=1.0)],
}


def test_every_builtin_estimator_has_a_loop_reference():
    assert set(LOOP_REFERENCES) == set(KNOB_CASES) == set(ADVANTAGE_ESTIMATORS) - {"custom"}


def test_config_union_and_registry_name_the_same_estimators():
    # One list of names: each tag of the config union is registered with that very variant class.
    tags = union_tags(EstimatorConfig)
    assert set(tags) == set(ADVANTAGE_ESTIMATORS)
    assert all(ADVANTAGE_ESTIMATORS[name].config is cls for name, cls in tags.items())


def _random_batch(seed: int, n_groups: int):
    rng = random.Random(seed)
    sizes = [rng.randint(1, 6) for _ in range(n_groups)]
    g, r = [], []
    for gid, size in zip(rng.sample(range(1000), n_groups), sizes, strict=True):
        discrete = rng.random() < 0.4  # some groups tie (often all equal) on a 0/1 reward
        g += [gid] * size
        r += [float(rng.randint(0, 1)) if discrete else rng.uniform(-2, 2) for _ in range(size)]
    lengths = [rng.randint(1, 9) for _ in r]
    tr = [[rng.uniform(-1, 1) for _ in range(n)] for n in lengths]
    v = [[rng.uniform(-1, 1) for _ in range(n)] for n in lengths]
    return r, g, lengths, tr, v


def _pad(rows: list[list[float]], T: int, fill: float) -> torch.Tensor:
    return torch.tensor([row + [fill] * (T - len(row)) for row in rows], dtype=torch.float64)


@pytest.mark.parametrize("seed,n_groups", [(0, 1), (1, 3), (2, 8), (3, 17), (4, 40)])
@pytest.mark.parametrize("name", sorted(LOOP_REFERENCES))
def test_loop_vs_vectorised(name, seed, n_groups):
    r, g, lengths, tr, v = _random_batch(seed, n_groups)
    T = max(lengths)
    mask = _pad([[1.0] * n for n in lengths], T, 0.0)
    # The greedy reward of each group (remax's baseline): sometimes equal to a sample's reward.
    rng = random.Random(seed + 1000)
    greedy = {gid: rng.choice([0.0, 1.0, rng.uniform(-2, 2)]) for gid in sorted(set(g))}
    baselines = [greedy[gid] for gid in g]
    inputs = AdvantageInputs(torch.tensor(r, dtype=torch.float64), torch.tensor(g), mask,
                             _pad(tr, T, 123.0), _pad(v, T, -45.0),  # garbage in the padding
                             torch.tensor(baselines, dtype=torch.float64))
    for knobs in KNOB_CASES[name]:
        if name == "grpo" and knobs["scale"] == "batch" and len(r) < 2:
            continue
        cfg = estimator(name, **knobs)  # the loop reference gets every knob, defaults included
        out = compute_advantages(cfg, inputs)
        extra = {"baselines": baselines} if name == "remax" else {}
        expected = LOOP_REFERENCES[name](r, g, lengths, tr, v, **cfg.knobs(), **extra)
        torch.testing.assert_close(out.token_advantages, _pad(expected, T, 0.0), atol=1e-9, rtol=1e-9,
                                   msg=lambda m, k=knobs: f"{name} {k}: {m}")
        if out.advantages is not None:
            torch.testing.assert_close(out.advantages, torch.tensor([row[0] for row in expected], dtype=torch.float64),
                                       atol=1e-9, rtol=1e-9)
        if name == "gae":  # returns R_t = A_t + V_t with the unwhitened A_t
            raw = loop_gae(r, g, lengths, tr, v, **{**cfg.knobs(), "whiten": False})
            ret = [[a + vv for a, vv in zip(ra, rv, strict=False)] for ra, rv in zip(raw, v, strict=True)]
            torch.testing.assert_close(out.returns, _pad(ret, T, 0.0), atol=1e-9, rtol=1e-9)


# ---------------------------------------------------------------------------------------------
# Registry behaviour
# ---------------------------------------------------------------------------------------------
class _Unregistered(Variant):
    name: Literal["unregistered"] = "unregistered"
    """Name."""
    alpha: float = 1.0
    """A knob."""


def test_registry_rejects_duplicates_unknown_names_and_mismatched_knobs():
    with pytest.raises(ValueError, match="already registered"):
        register_estimator(GRPOEstimator)(lambda x, *, std, scale, eps: x)
    with pytest.raises(TypeError, match=r"takes keywords \['beta'\] but _Unregistered has knobs \['alpha'\]"):
        register_estimator(_Unregistered)(lambda x, *, beta: x)
    assert "unregistered" not in ADVANTAGE_ESTIMATORS
    x = AdvantageInputs(R4, ONE_GROUP, torch.ones(4, 1), torch.zeros(4, 1))
    with pytest.raises(ValueError, match="unknown advantage estimator 'unregistered'"):
        compute_advantages(_Unregistered(), x)
    with pytest.raises(ValueError, match="needs critic values"):
        compute_advantages(GAEEstimator(), x)


def test_config_variants_own_their_knobs_and_accept_a_bare_name():
    base = {"scores": "s", "output": "o", "reference": "r"}
    assert parse_config(AdvantageConfig, {**base, "estimator": "rloo"}).estimator.name == "rloo"
    gae_cfg = parse_config(AdvantageConfig, {**base, "estimator": {"name": "gae", "lam": 0.9}}).estimator
    assert gae_cfg == GAEEstimator(lam=0.9) and gae_cfg.knobs() == {"gamma": 1.0, "lam": 0.9, "whiten": True, "eps": 1e-6}
    assert AdvantageConfig(scores=Path("s"), output=Path("o")).estimator == GRPOEstimator()
    with pytest.raises(ConfigError, match=r"unknown key 'estimator.lam'; allowed keys: eps, name, scale, std"):
        parse_config(AdvantageConfig, {**base, "estimator": {"name": "grpo", "lam": 0.9}})
    with pytest.raises(ConfigError, match="key 'estimator.lam': Input should be less than or equal to 1"):
        parse_config(AdvantageConfig, {**base, "estimator": {"name": "gae", "lam": 1.5}})


def test_float32_inputs_stay_float32_and_match_float64():
    out32 = grpo(R4.float(), ONE_GROUP, std="sample", scale="group")
    assert out32.advantages.dtype == torch.float32
    out64 = grpo(R4, ONE_GROUP, std="sample", scale="group")
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(out32.advantages.tolist(),
                                                                 out64.advantages.tolist(), strict=True))


# ---------------------------------------------------------------------------------------------
# User estimators by import path
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def user_estimators(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # user_estimators.py


def test_custom_estimator_sequence_and_token_advantages(user_estimators):
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float64)
    x = AdvantageInputs(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64), torch.tensor([0, 0, 1]), mask,
                        torch.zeros(3, 3, dtype=torch.float64))
    out = compute_advantages(CustomEstimator(function="user_estimators:scaled_reward", kwargs={"scale": 2.0}), x)
    torch.testing.assert_close(out.advantages, torch.tensor([2.0, -4.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(out.token_advantages, torch.tensor([[2.0, 2.0, 0], [-4.0, 0, 0], [1.0, 1.0, 1.0]],
                                                                  dtype=torch.float64))
    out = compute_advantages(CustomEstimator(function="user_estimators:token_index"), x)
    assert out.advantages is None  # token-level: no sequence advantage
    torch.testing.assert_close(out.token_advantages, torch.tensor([[1.0, 2.0, 0], [1.0, 0, 0], [1.0, 2.0, 3.0]],
                                                                  dtype=torch.float64))  # padding zeroed


@pytest.mark.parametrize("function,error", [
    ("user_estimators:wrong_shape", r"'user_estimators:wrong_shape' returned shape \(2,\); expected a tensor of shape \(3,\)"),
    ("user_estimators:not_a_tensor", r"'user_estimators:not_a_tensor' returned list"),
    ("user_estimators:missing", r"estimator.function: cannot import 'user_estimators:missing': AttributeError"),
    ("no_such_module:fn", r"estimator.function: cannot import 'no_such_module:fn': ModuleNotFoundError"),
    ("user_estimators:NOT_CALLABLE", r"'user_estimators:NOT_CALLABLE' is a int, not a function"),
])
def test_custom_estimator_errors_name_the_import_path(user_estimators, function, error):
    x = AdvantageInputs(R4[:3], ONE_GROUP[:3], torch.ones(3, 1, dtype=torch.float64), torch.zeros(3, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=error):
        compute_advantages(CustomEstimator(function=function), x)
