"""The advantage stage end to end on small hand-built scores / rollouts / reference artifacts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rlpipe.schemas import ADVANTAGES, ConfigError, load_config, read_manifest, read_table_artifact
from rlpipe.stages.advantage.__main__ import main
from rlpipe.stages.advantage.config import AdvantageConfig, DrGRPOEstimator, GAEEstimator
from rlpipe.stages.advantage.estimators import AdvantageInputs, compute_advantages
from rlpipe.stages.advantage.kl import kl_token_rewards
from rlpipe.stages.advantage.run import run

# (group_id, sample_index, response length, reward); listed in the order the scores artifact holds
# them (not sorted), two shards: groups 5 and 9, then groups 1 and 3.
SCORE_ROWS = [
    (5, 2, 4, 0.4), (5, 0, 3, 1.0), (5, 3, 2, 0.2), (5, 1, 1, 0.8),
    (9, 0, 2, 0.5), (9, 1, 2, 0.5), (9, 2, 2, 0.5), (9, 3, 2, 0.5),  # all equal: zero variance
    (1, 0, 5, 0.0), (1, 1, 1, 1.0), (1, 2, 2, 1.0),
    (3, 0, 3, 0.7),  # a group of one
]


def _write_inputs(tmp_path, artifacts, *, with_reference: bool = False, values: bool = True):
    scores = [artifacts.score(g, s, n, r) for g, s, n, r in SCORE_ROWS]
    artifacts.write(tmp_path / "scores", artifacts.SCORES_, scores, rows_per_shard=8)
    gen = torch.Generator().manual_seed(0)
    rollouts, reference = [], []
    for g, s, n, _ in reversed(SCORE_ROWS):  # another order and one shard: joined by key
        logp = (-torch.rand(n, generator=gen, dtype=torch.float64)).tolist()
        ref = [lp - 0.05 * (k + 1) for k, lp in enumerate(logp)]  # k1 = 0.05, 0.10, ...
        rollouts.append(artifacts.rollout(g, s, [1, 2], list(range(3, 3 + n)), logp))
        v = torch.rand(n, generator=gen, dtype=torch.float64).tolist() if values else None
        reference.append(artifacts.reference(g, s, ref, v))
    artifacts.write(tmp_path / "rollouts", artifacts.ROLLOUTS_, rollouts)
    if with_reference:
        artifacts.write(tmp_path / "reference", artifacts.REFERENCE_, reference, rows_per_shard=5)


def test_grpo_end_to_end_golden_counts_order_and_cache(tmp_path, artifacts):
    _write_inputs(tmp_path, artifacts)
    config = AdvantageConfig(scores=tmp_path / "scores", rollouts=tmp_path / "rollouts", output=tmp_path / "adv",
                             estimator={"name": "grpo", "std": "population"})
    manifest = run(config)

    scores_manifest = read_manifest(tmp_path / "scores")
    assert manifest.shard_names == scores_manifest.shard_names == ["part-00000.parquet", "part-00001.parquet"]
    assert [f.rows for f in manifest.files] == [8, 4]
    table = read_table_artifact(tmp_path / "adv", ADVANTAGES).to_pylist()
    assert [(r["group_id"], r["sample_index"]) for r in table] == [(g, s) for g, s, _, _ in SCORE_ROWS]
    adv = {(r["group_id"], r["sample_index"]): r["advantage"] for r in table}
    # worked example (population std): [+1.265, +0.632, -0.632, -1.265]
    assert [adv[(5, s)] for s in range(4)] == pytest.approx([1.265, 0.632, -0.632, -1.265], abs=5e-4)
    # group 1: r = [0, 1, 1], mean 2/3, population std sqrt(2) / 3
    assert [adv[(1, s)] for s in range(3)] == pytest.approx([-math.sqrt(2), 1 / math.sqrt(2), 1 / math.sqrt(2)], abs=1e-5)
    assert all(adv[(9, s)] == 0.0 for s in range(4)) and adv[(3, 0)] == 0.0
    for row, (_, _, n, reward) in zip(table, SCORE_ROWS, strict=True):
        assert row["token_advantages"] == [pytest.approx(row["advantage"])] * n
        assert row["reward"] == pytest.approx(reward)
        assert row["returns"] is None and row["values"] is None and row["ref_logprobs"] is None and row["kl"] is None
        assert row["estimator"] == "grpo"
        assert json.loads(row["estimator_params"]) == {"std": "population", "scale": "group", "eps": 1e-6,
                                                       "kl_estimator": "k1", "kl_in_reward": False, "kl_beta": 0.05}
    assert manifest.config["estimator"] == {"name": "grpo", "std": "population", "scale": "group", "eps": 1e-6}
    assert manifest.extra["groups"] == 4
    assert manifest.extra["zero_variance_groups"] == 2  # group 9 (equal rewards) and group 3 (one sample)
    assert manifest.extra["zero_variance_fraction"] == 0.5
    rewards = [r for *_, r in SCORE_ROWS]
    assert manifest.extra["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert manifest.extra["response_tokens"] == sum(n for _, _, n, _ in SCORE_ROWS)
    assert set(manifest.inputs) == {"scores", "rollouts"}

    # Same config and inputs: cache hit (no rewrite); forced: the same content.
    assert run(config).created_at == manifest.created_at
    assert run(config, force=True).content_hash == manifest.content_hash
    # Another estimator: another key, another content.
    other = run(config.model_copy(update={"estimator": DrGRPOEstimator()}))
    assert other.cache_key != manifest.cache_key and other.content_hash != manifest.content_hash


def test_cli_runs_alone_on_saved_scores(tmp_path, artifacts, capsys):
    _write_inputs(tmp_path, artifacts)
    assert main([f"scores={tmp_path / 'scores'}", f"output={tmp_path / 'adv'}", "estimator=rloo"]) == 0
    assert "advantage: wrote" in capsys.readouterr().err  # (a log record: stages/common/log.py)
    table = read_table_artifact(tmp_path / "adv", ADVANTAGES).to_pylist()
    adv = {(r["group_id"], r["sample_index"]): r["advantage"] for r in table}
    # rloo: G / (G - 1) * (r - mean_g); group 5 mean 0.6
    assert [adv[(5, s)] for s in range(4)] == pytest.approx([4 / 3 * d for d in (0.4, 0.2, -0.2, -0.4)], abs=1e-6)
    assert read_manifest(tmp_path / "adv").inputs.keys() == {"scores"}


def test_cli_runs_a_user_estimator_by_import_path(tmp_path, artifacts, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # user_estimators.py
    _write_inputs(tmp_path, artifacts)
    assert main([f"scores={tmp_path / 'scores'}", f"output={tmp_path / 'adv'}", "estimator.name=custom",
                 "estimator.function=user_estimators:scaled_reward", "estimator.kwargs.scale=-2"]) == 0
    table = read_table_artifact(tmp_path / "adv", ADVANTAGES).to_pylist()
    for row, (_, _, n, reward) in zip(table, SCORE_ROWS, strict=True):  # A_i = -2 r_i on each of its n tokens
        assert row["advantage"] == pytest.approx(-2 * reward) and row["token_advantages"] == [pytest.approx(-2 * reward)] * n
        assert row["estimator"] == "custom"
        assert json.loads(row["estimator_params"])["function"] == "user_estimators:scaled_reward"
    saved = read_manifest(tmp_path / "adv").config["estimator"]  # the nested form is what is recorded
    assert saved == {"name": "custom", "function": "user_estimators:scaled_reward", "kwargs": {"scale": -2}}


def test_kl_in_reward_gae_end_to_end(tmp_path, artifacts):
    _write_inputs(tmp_path, artifacts, with_reference=True)
    # gamma = lambda = 1 and no whitening: the return at t = 0 is the KL-penalised total
    # R - beta * sum_t k1_t, and A_t = R_t - V_t.
    base = dict(scores=tmp_path / "scores", rollouts=tmp_path / "rollouts", reference=tmp_path / "reference",
                output=tmp_path / "adv", estimator={"name": "gae", "gamma": 1.0, "lam": 1.0, "whiten": False})
    manifest = run(AdvantageConfig(**base, kl={"in_reward": True, "beta": 6.0, "controller": "adaptive",
                                             "target": 0.01, "horizon": 100}))
    rows = {(r["group_id"], r["sample_index"]): r for r in read_table_artifact(tmp_path / "adv").to_pylist()}
    r51 = rows[(5, 1)]  # worked example: R_RM = 0.8, KL = 0.05, beta = 6 -> 0.5
    assert r51["kl"] == pytest.approx([0.05], abs=1e-6)
    assert r51["returns"] == pytest.approx([0.5], abs=1e-6)
    r5 = rows[(5, 0)]
    assert r5["kl"] == pytest.approx([0.05, 0.10, 0.15], abs=1e-6)
    # R = 1.0: token rewards [-0.3, -0.6, 1.0 - 0.9]; returns R_t = sum_{k>=t} r_k (gamma = 1)
    assert r5["returns"] == pytest.approx([-0.8, -0.5, 0.1], abs=1e-5)
    # A_t = R_t - V_t (lambda = 1)
    assert r5["token_advantages"] == pytest.approx([g - v for g, v in zip(r5["returns"], r5["values"], strict=True)],
                                                   abs=1e-5)
    assert r5["advantage"] is None and r5["reward"] == pytest.approx(1.0)
    # KL per sequence: 0.05 * n (n + 1) / 2 for a response of n tokens
    lengths = [n for _, _, n, _ in SCORE_ROWS]
    kl_seq = sum(0.05 * n * (n + 1) / 2 for n in lengths) / len(lengths)
    assert manifest.extra["kl_seq_mean"] == pytest.approx(kl_seq, abs=1e-6)
    # adaptive controller: e = clip(kl / 0.01 - 1, -0.2, 0.2) = 0.2 -> 6 * (1 + 0.2 * 12 / 100)
    assert manifest.extra["kl_beta_next"] == pytest.approx(6 * (1 + 0.2 * 12 / 100))

    # With whitening and lambda < 1: the artifact equals the pure functions on the same numbers.
    gae_cfg = GAEEstimator(gamma=1.0, lam=0.9, whiten=True)
    manifest = run(AdvantageConfig(**{**base, "estimator": gae_cfg}, kl={"in_reward": True, "beta": 0.5}))
    rows = read_table_artifact(tmp_path / "adv").to_pylist()
    T = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths], dtype=torch.float64)

    def pad(key):
        return torch.tensor([r[key] + [0.0] * (T - len(r[key])) for r in rows], dtype=torch.float64)

    rewards = torch.tensor([r["reward"] for r in rows], dtype=torch.float64)
    token_rewards = kl_token_rewards(rewards, pad("kl"), mask, 0.5)
    expected = compute_advantages(gae_cfg, AdvantageInputs(rewards, torch.arange(len(rows)), mask, token_rewards,
                                                           pad("values")))
    torch.testing.assert_close(pad("token_advantages"), expected.token_advantages, atol=1e-5, rtol=0)
    torch.testing.assert_close(pad("returns"), expected.returns, atol=1e-5, rtol=0)
    assert "kl_beta_next" in manifest.extra and manifest.extra["kl_beta_next"] == 0.5  # fixed controller


def test_group_estimator_with_reference_records_ref_logprobs_and_kl(tmp_path, artifacts):
    _write_inputs(tmp_path, artifacts, with_reference=True, values=False)
    run(AdvantageConfig(scores=tmp_path / "scores", rollouts=tmp_path / "rollouts", reference=tmp_path / "reference",
                        output=tmp_path / "adv", kl={"estimator": "k2"}))
    for row in read_table_artifact(tmp_path / "adv").to_pylist():
        n = len(row["token_advantages"])
        assert row["kl"] == pytest.approx([0.5 * (0.05 * (k + 1)) ** 2 for k in range(n)], abs=1e-6)
        assert len(row["ref_logprobs"]) == n and row["values"] is None and row["returns"] is None


def test_errors_name_the_problem(tmp_path, artifacts):
    _write_inputs(tmp_path, artifacts, with_reference=True, values=False)
    base = dict(scores=tmp_path / "scores", rollouts=tmp_path / "rollouts", reference=tmp_path / "reference",
                output=tmp_path / "adv")
    with pytest.raises(ValueError, match="holds no critic values"):
        run(AdvantageConfig(**base, estimator="gae"))
    with pytest.raises(ConfigError, match="kl.in_reward needs both"):
        load_config(AdvantageConfig, None, [f"scores={tmp_path}/scores", f"output={tmp_path}/out", "kl.in_reward=true"])
    with pytest.raises(ConfigError, match="needs kl.target"):
        load_config(AdvantageConfig, None, [f"scores={tmp_path}/scores", f"output={tmp_path}/out", "kl.controller=adaptive"])
    # a rollouts artifact that lacks a scored row
    partial = [artifacts.rollout(g, s, [1], [3] * n, [-1.0] * n) for g, s, n, _ in SCORE_ROWS[:-1]]
    artifacts.write(tmp_path / "partial", artifacts.ROLLOUTS_, partial)
    with pytest.raises(ValueError, match=r"partial: no row for key \{'iteration': 0, 'group_id': 3, 'sample_index': 0\}"):
        run(AdvantageConfig(**{**base, "rollouts": tmp_path / "partial"}))
    # a response length that disagrees with the scores
    wrong = [artifacts.rollout(g, s, [1], [3] * (n + (g == 9)), [-1.0] * (n + (g == 9))) for g, s, n, _ in SCORE_ROWS]
    artifacts.write(tmp_path / "wrong", artifacts.ROLLOUTS_, wrong)
    with pytest.raises(ValueError, match="response_logprobs: row 4 has 3 values, expected 2"):
        run(AdvantageConfig(**{**base, "rollouts": tmp_path / "wrong"}))


def test_groups_are_per_iteration_and_token_level_estimators_leave_advantage_null(tmp_path, artifacts):
    # group_id 0 in two iterations: two groups, not one of four.
    rows = [artifacts.score(0, 0, 2, 1.0, iteration=0), artifacts.score(0, 1, 1, 0.0, iteration=0),
            artifacts.score(0, 0, 3, 5.0, iteration=1), artifacts.score(0, 1, 1, 3.0, iteration=1)]
    artifacts.write(tmp_path / "scores", artifacts.SCORES_, rows)
    manifest = run(AdvantageConfig(scores=tmp_path / "scores", output=tmp_path / "adv", estimator="dr_grpo"))
    assert manifest.extra["groups"] == 2
    assert [r["advantage"] for r in read_table_artifact(tmp_path / "adv").to_pylist()] == [0.5, -0.5, 1.0, -1.0]

    run(AdvantageConfig(scores=tmp_path / "scores", output=tmp_path / "adv", estimator="reinforce_pp_baseline"))
    table = read_table_artifact(tmp_path / "adv").to_pylist()
    # centred [0.5, -0.5, 1, -1] on 2, 1, 3, 1 tokens; whitened over those 7 tokens
    tokens = [0.5, 0.5, -0.5, 1.0, 1.0, 1.0, -1.0]
    mu, sd = sum(tokens) / 7, math.sqrt(sum((x - sum(tokens) / 7) ** 2 for x in tokens) / 6)
    assert [r["advantage"] for r in table] == [None] * 4
    assert [x for r in table for x in r["token_advantages"]] == pytest.approx([(x - mu) / sd for x in tokens], abs=1e-5)
