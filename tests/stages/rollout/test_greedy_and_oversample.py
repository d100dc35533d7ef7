"""Rollout extras for ReMax and dynamic sampling: the greedy baseline row and oversampling."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpipe.schemas import ConfigError, load_config, read_manifest, read_table_artifact
from rlpipe.schemas.rollouts import GREEDY_SAMPLE_INDEX
from rlpipe.stages.rollout.config import RolloutConfig
from rlpipe.stages.rollout.run import run


def config(policy: Path, prompts: Path, out: Path, **kw) -> RolloutConfig:
    knobs = dict(group_size=3, temperature=1.0, max_new_tokens=6, num_prompts=4, batch_size=3, groups_per_shard=2)
    return RolloutConfig(checkpoint=policy, prompts=prompts, output=out, **(knobs | kw))


def test_greedy_baseline_row_is_the_greedy_response_and_leaves_the_samples_alone(
        tiny_policy_dir, prompts_dir, tmp_path, rollout_check):
    with_greedy = config(tiny_policy_dir, prompts_dir, tmp_path / "g", greedy_baseline=True)
    manifest = run(with_greedy)
    rows = read_table_artifact(with_greedy.output).to_pylist()
    assert manifest.rows == 4 * (3 + 1)
    assert manifest.extra["samples"] == 12 and manifest.extra["greedy_rows"] == 4 and manifest.extra["groups"] == 4
    # Each group: the greedy row first (sample_index -1, temperature 0 recorded), then 0..G-1.
    for g in range(4):
        group = [r for r in rows if r["group_id"] == g]
        assert [r["sample_index"] for r in group] == [GREEDY_SAMPLE_INDEX, 0, 1, 2]
        assert group[0]["sampling"]["temperature"] == 0.0 and group[1]["sampling"]["temperature"] == 1.0

    # The greedy rows are what a temperature-0 rollout of the same prompts gives (G = 1) ...
    greedy = config(tiny_policy_dir, prompts_dir, tmp_path / "t0", group_size=1, temperature=0.0)
    run(greedy)
    argmax = {r["group_id"]: r for r in read_table_artifact(greedy.output).to_pylist()}
    for r in rows:
        if r["sample_index"] == GREEDY_SAMPLE_INDEX:
            want = argmax[r["group_id"]]
            assert (r["response_token_ids"], r["response"], r["finish_reason"]) == (
                want["response_token_ids"], want["response"], want["finish_reason"])
            assert r["response_logprobs"] == pytest.approx(want["response_logprobs"], abs=1e-5)
    # ... and the samples are exactly those of the same rollout without the greedy rows.
    plain = config(tiny_policy_dir, prompts_dir, tmp_path / "p")
    run(plain)
    samples = [r for r in rows if r["sample_index"] != GREEDY_SAMPLE_INDEX]
    assert samples == read_table_artifact(plain.output).to_pylist()


def test_oversample_generates_the_next_prompts_in_order(tiny_policy_dir, prompts_dir, tmp_path):
    # 4 prompts x 1.5 = 6 groups from offset 9 of the 12 prompts: rows 9, 10, 11, 0, 1, 2.
    cfg = config(tiny_policy_dir, prompts_dir, tmp_path / "o", oversample=1.5, prompt_offset=9, max_new_tokens=2)
    assert cfg.group_count() == 6
    run(cfg)
    rows = read_table_artifact(cfg.output).to_pylist()
    prompts = [p["prompt_id"] for p in read_table_artifact(prompts_dir).to_pylist()]
    by_group = {r["group_id"]: r["prompt_id"] for r in rows}
    assert by_group == {g: prompts[(9 + g) % 12] for g in range(6)}
    assert read_manifest(cfg.output).extra["groups"] == 6
    # The first 4 groups are those of the rollout without oversampling (same seed, iteration, ids).
    base = config(tiny_policy_dir, prompts_dir, tmp_path / "b", prompt_offset=9, max_new_tokens=2)
    run(base)
    assert [r for r in rows if r["group_id"] < 4] == read_table_artifact(base.output).to_pylist()


def test_group_count_rounds_and_oversample_needs_num_prompts(tmp_path):
    def cfg(**kw):
        return RolloutConfig(checkpoint=tmp_path / "c", prompts=tmp_path / "p", output=tmp_path / "o", **kw)

    assert cfg(num_prompts=10, oversample=1.1).group_count() == 11  # 10 * 1.1 = 11.000000000000002 in floats
    assert cfg(num_prompts=16, oversample=1.01).group_count() == 17  # 16.16 -> 17
    assert cfg(num_prompts=16).group_count() == 16 and cfg().group_count() is None
    with pytest.raises(ConfigError, match="oversample multiplies num_prompts"):
        load_config(RolloutConfig, None, ["checkpoint=c", "prompts=p", "output=o", "oversample=2"])
