"""evaluate stage: greedy held-out accuracy of a checkpoint, built from the rollout and score stages.

    python -m rlpipe.stages.evaluate checkpoint=runs/x/iter_0003/policy prompts=task/heldout \
        output=runs/x/iter_0003/eval

Runs `rollout` (group_size 1, temperature 0: greedy) into `<output>/rollouts`, `score` (one
answer_match component) into `<output>/scores`, then writes the `metrics` artifact at `<output>`
(manifest last). Each sub-stage keeps its own cache key, so a rerun recomputes nothing finished.
"""

from __future__ import annotations

import shutil
import time

import numpy as np

from rlpipe.schemas import (
    METRICS,
    SCORES,
    Manifest,
    read_table_artifact,
    write_table_artifact,
)
from rlpipe.schemas.errors import DataError
from rlpipe.stages.common.stage_io import StageStart, opens
from rlpipe.stages.evaluate.config import EvaluateConfig
from rlpipe.stages.rollout.config import RolloutConfig
from rlpipe.stages.score.config import AnswerMatchComponent, ScoreConfig

STAGE = "evaluate"


@opens(STAGE)
def run(config: EvaluateConfig, start: StageStart) -> Manifest:
    from rlpipe.stages.rollout.run import run as rollout
    from rlpipe.stages.score.run import run as score

    inputs, key = start.inputs, start.key
    started = start.started

    rollout_cfg = RolloutConfig(
        checkpoint=config.checkpoint, prompts=config.prompts, output=config.output / "rollouts",
        run=config.run, iteration=config.iteration, policy_version=config.iteration,
        engine=config.engine, group_size=1, temperature=0.0, max_new_tokens=config.max_new_tokens,
        batch_size=config.batch_size, groups_per_shard=1 << 20, seed=config.seed, stop=config.stop,
        environment=config.environment, chat_template=config.chat_template, system_prompt=config.system_prompt,
        loading=config.loading, dtype=config.dtype,
    )
    score_cfg = ScoreConfig(
        rollouts=rollout_cfg.output, output=config.output / "scores",
        components=[AnswerMatchComponent(name="answer_match", mode=config.match)], loading=config.loading,
    )
    rolled = rollout(rollout_cfg, force=start.force)
    score(score_cfg, force=start.force)

    scores = read_table_artifact(score_cfg.output, SCORES,
                                 columns=["reward", "reward__answer_match", "sampled_tokens", "finish_reason"])
    metrics = summarize(
        scores.column("reward__answer_match").to_numpy(), scores.column("reward").to_numpy(),
        scores.column("sampled_tokens").to_numpy(),  # the model's tokens, not an episode's environment's
        np.array([r == "length" for r in scores.column("finish_reason").to_pylist()]),
    )
    if config.environment is not None:  # episodes: how the policy used the environment
        metrics["turns_mean"] = float(rolled.extra["turns_mean"])
        metrics["tool_calls_per_episode"] = rolled.extra["tool_calls"] / metrics["num_prompts"]
    names = sorted(metrics)
    manifest = write_table_artifact(
        config.output, METRICS,
        {"run": [config.run] * len(names), "iteration": [config.iteration] * len(names),
         "stage": [STAGE] * len(names), "step": [0] * len(names), "name": names,
         "value": [metrics[n] for n in names]},
        stage=STAGE, config=config.resolved(), inputs=inputs, cache_key=key,
        wall_time_s=time.time() - started,
    )
    if not config.keep_rollouts:
        shutil.rmtree(rollout_cfg.output)
        shutil.rmtree(score_cfg.output)
    return manifest


def summarize(correct: np.ndarray, reward: np.ndarray, length: np.ndarray, truncated: np.ndarray) -> dict[str, float]:
    """Eval metrics from per-prompt arrays (one greedy response per prompt).

    Shape:
        every input (N,) -> scalars.
    """
    n = len(correct)
    if n == 0:
        raise DataError("no eval responses to summarise (empty prompts artifact?)")
    return {
        "accuracy": float(correct.mean()),
        "reward_mean": float(reward.mean()),
        "response_length_mean": float(length.mean()),
        "truncated_fraction": float(truncated.mean()),
        "num_prompts": float(n),
    }
