"""The presets that train a reward model (`grpo_rm`, `ppo`): they name where its pairs come from
(the user's data.preferences, or synthetic pairs said explicitly), the reward model learns its
pairs (held-out pairwise accuracy >= 0.9, no near-chance flag), GRPO on its score raises the
reward, and a reward model at chance says so on stderr and in its manifest."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpipe.pipelines.layout import RunLayout
from rlpipe.pipelines.plan import Plan
from rlpipe.pipelines.preset import PRESETS_DIR, load_preset
from rlpipe.pipelines.runner import Pipeline
from rlpipe.schemas import read_manifest
from rlpipe.schemas.config_files import ConfigError
from rlpipe.stages import get_stage
from rlpipe.stages.reward_model.core import chance_band, near_chance


def _setup_calls(preset) -> dict[str, list]:
    """Stage name -> the configs of its set-up calls in a run of `preset`."""
    calls: dict[str, list] = {}
    for call in Plan(preset, RunLayout(Path("runs") / preset.name)).setup():
        calls.setdefault(call.name, []).append(call.config)
    return calls


@pytest.mark.parametrize("name", ["grpo_rm", "ppo"])
def test_builtin_reward_model_presets_say_their_pairs_are_synthetic(name):
    import yaml

    raw = yaml.safe_load((PRESETS_DIR / f"{name}.yaml").read_text())
    assert raw["preferences"] == {"kind": "answers", "wrong": "zero_padded"} and "preferences" not in raw["data"]
    prefs = _setup_calls(load_preset(name))["preferences"]
    assert [(c.kind, c.wrong) for c in prefs] == [("answers", "zero_padded")]


def test_a_trained_reward_model_without_named_pairs_is_refused():
    """No data.preferences and no preferences.kind: refused at load, saying both ways to give pairs
    (tests/test_user_errors.py runs it through the command line)."""
    with pytest.raises(ConfigError, match=r"grpo_rm.yaml: the reward_model section trains a reward model, but no "
                                          r"preference pairs are named: give yours with data.preferences=FILE.*"
                                          r"preferences.kind=answers"):
        load_preset("grpo_rm", ["preferences={wrong: zero_padded}"])


def test_the_users_pairs_or_a_given_reward_model_need_no_preferences_kind(tmp_path):
    """data.preferences=FILE: the pairs are imported and trained on, no synthetic ones are made;
    model.reward_model: nothing is trained, so no pairs are needed."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n')
    calls = _setup_calls(load_preset("grpo_rm", ["preferences={}", f"data.preferences={pairs}"]))
    assert "preferences" not in calls
    imported = [c for c in calls["import_data"] if c.source == pairs]
    assert len(imported) == 1 and calls["reward_model"][0].preferences == imported[0].preferences
    calls = _setup_calls(load_preset("grpo_rm", ["preferences={}", f"model.reward_model={tmp_path / 'rm'}"]))
    assert "preferences" not in calls and "reward_model" not in calls


def _learnt(manifest) -> None:
    extra = manifest.extra
    assert extra["eval_accuracy"] >= 0.9, extra
    assert extra["eval_near_chance"] is False and extra["eval_pairs"] == 90, extra  # 10% of 900 pairs


@pytest.mark.integration
@pytest.mark.slow
def test_grpo_rm_preset_reward_model_learns_and_reward_rises(tmp_path):
    """The preset as shipped, shortened to 12 iterations (no intermediate evaluations)."""
    run_dir = tmp_path / "grpo_rm"
    records = Pipeline(load_preset("grpo_rm", ["iterations=12", "eval_every=0"]), run_dir, log=lambda s: None).run()
    _learnt(read_manifest(run_dir / "models/reward"))
    # Rising: the RL reward (mean reward-model score of the samples) of the last 4 iterations
    # above that of the first 4. Means over 4 iterations x 128 samples, so one lucky batch
    # cannot decide it.
    rewards = [r.metrics["reward_mean"] for r in records]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4, rewards


@pytest.mark.integration
@pytest.mark.slow
def test_ppo_preset_reward_model_learns(tmp_path):
    """The ppo preset's set-up up to its reward model, with a shorter SFT (the pairs differ in a
    leading zero, which the reward model learns whatever the warm start knows of sums)."""
    preset = load_preset("ppo", ["sft.max_steps=50"])
    plan = Plan(preset, RunLayout(tmp_path / "ppo"))
    for call in plan.setup():
        manifest = get_stage(call.name).run(call.config)
        if call.name == "reward_model":
            break
    _learnt(manifest)


def test_chance_band_is_two_coin_standard_deviations():
    # sd of the mean of n fair coins = 0.5 / sqrt(n); the band is two of them: 1 / sqrt(n)
    assert chance_band(100) == pytest.approx(0.1) and chance_band(400) == pytest.approx(0.05)
    assert near_chance(0.59, 100) and not near_chance(0.61, 100)
    # the at-chance reward models of the issue (0.455-0.495 on 200 pairs) and below-coin rankings
    assert near_chance(0.455, 200) and near_chance(0.495, 200) and near_chance(0.2, 200)
    assert not near_chance(0.9, 90)


def test_reward_model_at_chance_warns(tmp_path, tiny_policy_dir, caplog):
    """Pairs whose two responses are the same text cannot be ranked (r_c == r_r, accuracy 0): the
    stage ends with a one-line warning (a WARNING record of its logger) and flags its manifest."""
    import logging

    import pyarrow as pa

    from rlpipe.schemas import PREFERENCES, write_table_artifact
    from rlpipe.schemas.config_files import parse_config

    n = 40
    table = pa.table({"pair_id": [f"p{i}" for i in range(n)], "prompt": [f"{i}+1=" for i in range(n)],
                      "chosen": [str(i + 1) for i in range(n)], "rejected": [str(i + 1) for i in range(n)],
                      "margin": pa.nulls(n, pa.float32())}, schema=PREFERENCES.arrow())
    write_table_artifact(tmp_path / "prefs", PREFERENCES, table, stage="test")
    stage = get_stage("reward_model")
    config = parse_config(stage.config_class(), {"preferences": tmp_path / "prefs", "base": tiny_policy_dir,
                                                 "output": tmp_path / "rm", "eval_fraction": 0.25, "max_length": 32})
    with caplog.at_level(logging.INFO, logger="rlpipe"):
        manifest = stage.run(config)
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and r.name == "rlpipe.stages.reward_model.run"]
    assert len(warnings) == 1 and warnings[0].startswith("reward_model: "), caplog.records
    assert "held-out pairwise accuracy 0.0000 is within chance (0.5 + 0.316" in warnings[0]  # 1/sqrt(10)
    assert manifest.extra["eval_near_chance"] is True and manifest.extra["eval_pairs"] == 10
    assert manifest.extra["eval_chance_band"] == pytest.approx(10 ** -0.5)
