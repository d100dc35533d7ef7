"""Every count of a response's tokens after the rollout counts what the model sampled
(`schemas.rollouts.sampled_lengths`), never an episode's environment tokens: rollout's
`generated_tokens` and tokens/s, its summary's lengths, evaluate's `response_length_mean` and the
report's response length all equal the response_mask's ones. (Score's `sampled_tokens`:
tests/stages/score/test_episodes.py; optimize's `max_len`: tests/stages/optimize/test_max_len.py.)"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest

from rlpipe.pipelines.report import iteration_metrics
from rlpipe.schemas import PROMPTS, read_table_artifact, write_table_artifact
from rlpipe.schemas.rollouts import sampled_lengths
from rlpipe.stages.evaluate.config import EvaluateConfig
from rlpipe.stages.evaluate.run import run as evaluate
from rlpipe.stages.rollout.config import RolloutConfig
from rlpipe.stages.rollout.run import run as rollout

pytestmark = pytest.mark.multiturn
HERE = Path(__file__).parent
# Replies of ~10 tokens after each of 3 model turns of at most 4: most of an episode is the environment's.
ECHO = {"function": "user_environments:make_echo", "kwargs": {"reply": "Q: 1+1=", "reward": 0.25}, "max_turns": 3}
MASK = pa.list_(pa.int8())


@pytest.fixture(autouse=True)
def _user_environments(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # user_environments.py


def _counts(rollouts: Path) -> tuple[list[int], list[int]]:
    """(the response_mask's ones, the token positions) of every row, from the Parquet alone."""
    df = pl.read_parquet(rollouts / "part-*.parquet")
    return [sum(m) for m in df["response_mask"]], df["response_token_ids"].list.len().to_list()


def test_sampled_lengths_counts_the_masks_ones_or_every_token_of_a_single_turn_row():
    masks = pa.array([[1, 1, 0, 0, 1], None, [0, 1]], MASK)
    assert sampled_lengths(masks, [5, 3, 2], what="x") == [3, 3, 1]
    assert sampled_lengths(pa.array([None, None], MASK), [4, 2], what="x") == [4, 2]
    with pytest.raises(ValueError, match="x: row 0 has 5 mask values, expected 4"):
        sampled_lengths(masks, [4, 3, 2], what="x")


def test_rollout_and_report_count_the_tokens_the_model_sampled(tiny_policy_dir, prompts_dir, tmp_path):
    run_dir = tmp_path / "run"
    out = run_dir / "iter_0000" / "rollouts"  # where the report reads iteration 0's rollouts
    manifest = rollout(RolloutConfig(checkpoint=tiny_policy_dir, prompts=prompts_dir, output=out, group_size=2,
                                     max_new_tokens=4, groups_per_shard=2, batch_size=2, seed=3, environment=ECHO))
    sampled, positions = _counts(out)
    assert sum(positions) > 2 * sum(sampled)  # the environment wrote most tokens: counting them shows
    timing = manifest.extra["timing"]
    assert timing["generated_tokens"] == sum(sampled)
    assert timing["tokens_per_s"] == pytest.approx(sum(sampled) / timing["generate_s"], rel=0.05)
    assert manifest.extra["response_tokens"] == sum(sampled)
    assert manifest.extra["response_length_mean"] == round(sum(sampled) / len(sampled), 3)
    assert iteration_metrics(run_dir, 0)["response_length"] == pytest.approx(sum(sampled) / len(sampled))


def test_evaluate_counts_the_tokens_the_model_sampled(tiny_policy_dir, tmp_path):
    n = 6
    heldout = write_table_artifact(tmp_path / "heldout", PROMPTS, {
        "prompt_id": [f"h{i}" for i in range(n)], "prompt": [f"Q: {i}+{i}=" for i in range(n)],
        "answer": [str(2 * i) for i in range(n)], "metadata": [None] * n, "messages": [None] * n}, stage="test")
    assert heldout.rows == n
    config = EvaluateConfig(checkpoint=tiny_policy_dir, prompts=tmp_path / "heldout", output=tmp_path / "eval",
                            max_new_tokens=4, environment=ECHO)
    evaluate(config)
    sampled, positions = _counts(config.output / "rollouts")
    assert sum(positions) > 2 * sum(sampled)
    metrics = dict(zip(*read_table_artifact(config.output, "metrics").select(["name", "value"]).to_pydict().values(),
                       strict=True))
    assert metrics["response_length_mean"] == pytest.approx(sum(sampled) / n)
    scores = read_table_artifact(config.output / "scores", "scores")
    assert scores["sampled_tokens"].to_pylist() == sampled and scores["response_length"].to_pylist() == positions
