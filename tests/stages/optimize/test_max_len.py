"""seq-mean-token-sum-norm's constant L (`optimize.max_len`, unset) is the most tokens one response
of the batch sampled: an episode's environment tokens, never trained on, do not lengthen it; on
single-turn data it is the longest response, as before."""

from __future__ import annotations

import pytest

from rlpipe.stages.common.distributed import DistInfo
from rlpipe.stages.optimize.data import load_batch
from rlpipe.stages.optimize.run import run as optimize
from rlpipe.stages.optimize.training import prepare

ONE_RANK = DistInfo(rank=0, world_size=1, local_rank=0)


def _lengths(arts) -> tuple[list[int], list[int]]:
    """(tokens the model sampled, token positions) per row, from the rollouts' mask and ids."""
    batch = load_batch(arts["rollouts"], arts["advantages"])
    masks = batch.sampled or [None] * len(batch)
    return ([len(ids) if m is None else int(sum(m)) for ids, m in zip(batch.response_ids, masks, strict=True)],
            [len(ids) for ids in batch.response_ids])


@pytest.mark.multiturn
def test_max_len_counts_the_sampled_tokens_of_episodes(tmp_path, tiny_tokenizer, tiny_policy_dir, build, make_config):
    arts = build(tmp_path, tiny_tokenizer, environment=0.0)  # 3 environment tokens in every response
    sampled, positions = _lengths(arts)
    assert max(positions) == max(sampled) + 3
    config = make_config(tmp_path, arts, tiny_policy_dir, agg_mode="seq-mean-token-sum-norm")
    work = prepare(config, ONE_RANK)
    assert work.max_len == max(sampled)
    assert work.batch.sampled_lengths().tolist() == sampled
    assert prepare(config.model_copy(update={"max_len": 50}), ONE_RANK).max_len == 50  # a set L is kept


def test_max_len_of_single_turn_data_is_the_longest_response(tmp_path, tiny_tokenizer, tiny_policy_dir, build,
                                                             make_config):
    arts = build(tmp_path, tiny_tokenizer)
    sampled, positions = _lengths(arts)
    assert sampled == positions
    assert prepare(make_config(tmp_path, arts, tiny_policy_dir), ONE_RANK).max_len == max(positions)


@pytest.mark.multiturn
def test_the_loss_is_divided_by_the_sampled_max_len(tmp_path, tiny_tokenizer, tiny_policy_dir, build, make_config,
                                                     read_metrics):
    """The first step's loss (the input policy in both runs) with L unset, times L, equals the loss
    with L set to the longest token positions, times that L: L unset is the sampled maximum."""
    arts = build(tmp_path, tiny_tokenizer, environment=0.0)
    sampled, positions = _lengths(arts)
    knobs = dict(agg_mode="seq-mean-token-sum-norm", epochs=1, recompute_old_logprobs=False)
    unset = make_config(tmp_path, arts, tiny_policy_dir, "unset", **knobs)
    positional = make_config(tmp_path, arts, tiny_policy_dir, "positions", max_len=max(positions), **knobs)
    loss = {}
    for config in (unset, positional):
        optimize(config)
        loss[config.max_len] = read_metrics(config.metrics_output)[1]["policy_loss"]
    assert loss[None] != 0.0
    assert loss[None] * max(sampled) == pytest.approx(loss[max(positions)] * max(positions), rel=1e-6)
