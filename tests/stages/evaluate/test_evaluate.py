"""evaluate: rollout (greedy, G=1) + score (answer_match) -> metrics, checked against an
independent greedy decoder (tests/greedy_reference.py, plain `model.generate`)."""

from __future__ import annotations

import pytest

from rlpipe.schemas import (
    METRICS,
    PROMPTS,
    exists,
    read_table_artifact,
    validate_artifact,
    write_table_artifact,
)
from rlpipe.stages.evaluate.config import EvaluateConfig
from rlpipe.stages.evaluate.run import run, summarize

PROMPTS_TEXT = [f"{a}+{b}=" for a in range(4) for b in range(5)]  # 20 prompts


@pytest.fixture(scope="module")
def reference(tiny_policy_dir):
    """Greedy responses of the tiny policy, decoded by the independent reference decoder."""
    from greedy_reference import greedy_generate

    from rlpipe.stages.common.tiny import load_checkpoint

    model, tok = load_checkpoint(tiny_policy_dir)
    return greedy_generate(model, tok, PROMPTS_TEXT, max_new_tokens=5)


@pytest.fixture(scope="module")
def heldout(tmp_path_factory, reference):
    # The first 10 answers are the policy's own greedy responses (correct by construction), the
    # last 10 are not: the accuracy must come out at exactly 0.5.
    answers = [g.response for g in reference[:10]] + [g.response + "9" for g in reference[10:]]
    path = tmp_path_factory.mktemp("eval") / "heldout"
    write_table_artifact(path, PROMPTS, {
        "prompt_id": [f"p{i}" for i in range(20)], "prompt": PROMPTS_TEXT, "answer": answers,
        "metadata": [None] * 20, "messages": [None] * 20}, stage="test")
    return path


def _metrics(path):
    rows = read_table_artifact(path, METRICS).to_pylist()
    assert {r["stage"] for r in rows} == {"evaluate"}
    return {r["name"]: r["value"] for r in rows}


def test_accuracy_matches_the_reference_decoder(tiny_policy_dir, heldout, reference, tmp_path):
    cfg = EvaluateConfig(checkpoint=tiny_policy_dir, prompts=heldout, output=tmp_path / "eval",
                         max_new_tokens=5, run="r", iteration=3)
    manifest = run(cfg)
    assert validate_artifact(cfg.output) == []
    m = _metrics(cfg.output)
    assert m["accuracy"] == 0.5 and m["reward_mean"] == 0.5 and m["num_prompts"] == 20
    assert m["response_length_mean"] == pytest.approx(sum(len(g.token_ids) for g in reference) / 20)
    assert m["truncated_fraction"] == pytest.approx(sum(g.finish_reason == "length" for g in reference) / 20)
    rollouts = read_table_artifact(cfg.output / "rollouts", "rollouts").to_pylist()
    assert [r["response"] for r in rollouts] == [g.response for g in reference]
    assert {r["iteration"] for r in rollouts} == {3} and {r["sampling"]["temperature"] for r in rollouts} == {0.0}
    assert set(manifest.inputs) == {"prompts", "checkpoint"}
    # Rerun: cache hit, same manifest.
    assert run(cfg).created_at == manifest.created_at


def test_keep_rollouts_false_leaves_only_metrics(tiny_policy_dir, heldout, tmp_path):
    cfg = EvaluateConfig(checkpoint=tiny_policy_dir, prompts=heldout, output=tmp_path / "eval",
                         max_new_tokens=5, keep_rollouts=False)
    run(cfg)
    assert exists(cfg.output) and _metrics(cfg.output)["accuracy"] == 0.5
    assert not (cfg.output / "rollouts").exists() and not (cfg.output / "scores").exists()


def test_summarize_values():
    import numpy as np

    m = summarize(np.array([1.0, 0.0, 1.0, 1.0]), np.array([1.0, -0.5, 1.0, 1.0]),
                  np.array([3, 8, 3, 2]), np.array([False, True, False, False]))
    assert m == {"accuracy": 0.75, "reward_mean": 0.625, "response_length_mean": 4.0,
                 "truncated_fraction": 0.25, "num_prompts": 4.0}
    with pytest.raises(ValueError, match="no eval responses"):
        summarize(*(np.array([]),) * 4)
