"""Held-out split and batch order of the reward-model stage."""

import numpy as np
import pytest

from rlpipe.stages.reward_model.core import epoch_batches, split_pairs


def test_split_is_deterministic_and_order_free():
    ids = [f"p{i}" for i in range(100)]
    train, held = split_pairs(ids, 0.2, seed=3)
    assert len(held) == 20 and len(train) == 80
    assert sorted(set(train) | set(held)) == list(range(100))
    # the same pair ids in reverse order land in the same split
    rev = ids[::-1]
    _, held_rev = split_pairs(rev, 0.2, seed=3)
    assert sorted(rev[i] for i in held_rev) == sorted(ids[i] for i in held)
    # another seed, another split
    _, held_other = split_pairs(ids, 0.2, seed=4)
    assert set(held_other) != set(held)


def test_split_edge_cases():
    assert len(split_pairs(["a", "b", "c"], 0.01, 0)[1]) == 1  # at least one held out
    assert len(split_pairs(["a", "b", "c"], 0.0, 0)[1]) == 0
    with pytest.raises(ValueError, match="'b' occurs more than once"):
        split_pairs(["a", "b", "b"], 0.1, 0)


def test_epoch_batches_cover_and_split_across_ranks():
    one = epoch_batches(10, 4, epoch=0, seed=0)
    assert [len(b) for b in one] == [4, 4, 2]
    assert sorted(np.concatenate(one).tolist()) == list(range(10))
    r0 = epoch_batches(10, 2, epoch=0, seed=0, rank=0, world_size=2)
    r1 = epoch_batches(10, 2, epoch=0, seed=0, rank=1, world_size=2)
    # two ranks x micro-batch 2 see exactly the rows of one rank's global batches of 4
    assert [sorted(np.concatenate([a, b]).tolist()) for a, b in zip(r0, r1, strict=True)] == [sorted(b.tolist()) for b in one[:2]]
    assert not np.array_equal(np.concatenate(one), np.concatenate(epoch_batches(10, 4, epoch=1, seed=0)))
