"""Pure pieces of the rollout stage: seeds, slicing, sampling math, stop strings."""

import math

import pytest
import torch

from rlpipe.stages.rollout.core import (
    find_stop,
    group_seed,
    sample_inverse_cdf,
    sampling_probs,
    select_prompts,
    shard_ranges,
    token_logprobs,
    worker_shards,
)


def test_group_seed_depends_on_seed_iteration_and_group_only():
    # golden values: the seed must be the same in every process and Python version (a resumed or
    # re-run stage samples the same tokens), so no hash() / id() / global RNG may enter it
    assert (group_seed(0, 0, 5), group_seed(1, 2, 3)) == (47667270, 224956286)
    seeds = {group_seed(s, it, g) for s in range(3) for it in range(3) for g in range(50)}
    assert len(seeds) == 3 * 3 * 50  # all distinct
    assert all(0 <= s < 2**30 for s in seeds)  # room for vLLM's seed + sample_index


def test_select_prompts_wraps_from_offset():
    assert select_prompts(5, None, 0) == [0, 1, 2, 3, 4]
    assert select_prompts(5, 3, 4) == [4, 0, 1]
    assert select_prompts(3, 7, 10) == [1, 2, 0, 1, 2, 0, 1]
    with pytest.raises(ValueError, match="no prompts"):
        select_prompts(0, None, 0)


def test_shards_and_workers_partition_the_groups():
    shards = shard_ranges(10, 4)
    assert [list(r) for r in shards] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert worker_shards(5, None, 1) == [0, 1, 2, 3, 4]
    w0, w1 = worker_shards(5, 0, 2), worker_shards(5, 1, 2)
    assert (w0, w1) == ([0, 2, 4], [1, 3])


def test_sampling_probs_temperature_topk_topp_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.10]]))
    # temperature 1, no filters: the distribution itself
    assert torch.allclose(sampling_probs(logits, 1.0, 0, 1.0), torch.tensor([[0.5, 0.25, 0.15, 0.10]]))
    # top_k = 2: renormalised 0.5 / 0.75, 0.25 / 0.75
    assert torch.allclose(sampling_probs(logits, 1.0, 2, 1.0), torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    # top_p = 0.7: 0.5 < 0.7 so the second token is needed too; mass 0.75 >= 0.7 stops there
    assert torch.allclose(sampling_probs(logits, 1.0, 0, 0.7), torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    # top_p = 0.5: the first token alone reaches the mass
    assert torch.allclose(sampling_probs(logits, 1.0, 0, 0.5), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    # temperature 2: p_i proportional to sqrt(q_i)
    q = torch.tensor([0.5, 0.25, 0.15, 0.10]).sqrt()
    assert torch.allclose(sampling_probs(logits, 2.0, 0, 1.0), (q / q.sum()).unsqueeze(0))


def test_inverse_cdf_sampling_by_hand_and_rows_independent():
    probs = torch.tensor([[0.5, 0.0, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4]])
    # cdf row 0 = [0.5, 0.5, 0.75, 1.0]: u = 0.5 -> first cdf > 0.5 is index 2 (the 0-prob token 1 is skipped)
    assert sample_inverse_cdf(probs, torch.tensor([0.0, 0.0])).tolist() == [0, 0]
    assert sample_inverse_cdf(probs, torch.tensor([0.5, 0.35])).tolist() == [2, 2]
    assert sample_inverse_cdf(probs, torch.tensor([0.9999, 0.65])).tolist() == [3, 3]
    # a row's draw depends only on its own probs and uniform
    alone = sample_inverse_cdf(probs[1:], torch.tensor([0.35]))
    assert alone.tolist() == [2]
    # empirical frequencies follow the probabilities
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    draws = sample_inverse_cdf(probs[1:].expand(20000, -1), u)
    freq = torch.bincount(draws, minlength=4).double() / 20000
    assert torch.allclose(freq, probs[1].double(), atol=0.01)


def test_token_logprobs_are_raw_log_softmax():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    got = token_logprobs(logits, torch.tensor([2, 1]))
    lse = math.log(math.e**1 + math.e**2 + math.e**3)
    assert got.tolist() == pytest.approx([3.0 - lse, -math.log(3.0)], abs=1e-6)


def test_find_stop_earliest_occurrence():
    assert find_stop("abc</s>def\n\n", ("\n\n", "</s>")) == 3
    assert find_stop("abc", ("x", "")) is None
    assert find_stop("a1b1", ("1",)) == 1
