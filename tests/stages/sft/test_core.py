"""SFT math: which tokens carry loss, the shifted labels, the global token-mean loss, the schedule."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlpipe.stages.sft.core import (
    IGNORE,
    Example,
    batch_schedule,
    collate,
    encode_example,
    lr_factor,
    num_steps,
    sft_loss,
)

EOS = 2


def test_answer_only_targets():
    e = encode_example([1, 10, 11, 12], [20, 21], EOS, max_length=64, loss_on="answer")
    assert e.input_ids == [1, 10, 11, 12, 20, 21, EOS]
    assert e.target == [False, False, False, False, True, True, True]  # answer + EOS
    full = encode_example([1, 10, 11, 12], [20, 21], EOS, max_length=64, loss_on="all")
    assert full.target == [False] + [True] * 6
    plain = encode_example([1, 10, 11], None, EOS, max_length=64, loss_on="answer")
    assert plain.input_ids == [1, 10, 11] and plain.target == [False, True, True]
    cut = encode_example([1, 10, 11, 12], [20, 21], EOS, max_length=5, loss_on="answer")
    assert cut.input_ids == [1, 10, 11, 12, 20] and cut.num_targets == 1


def test_collate_shifts_labels_and_pads_right():
    a = Example([1, 10, 20, EOS], [False, False, True, True])
    b = Example([1, 11, 12, 21, 22, EOS], [False, False, False, True, True, True])
    ids, att, labels = collate([a, b], pad_id=0)
    assert ids.tolist() == [[1, 10, 20, EOS, 0, 0], [1, 11, 12, 21, 22, EOS]]
    assert att.tolist() == [[1, 1, 1, 1, 0, 0], [1] * 6]
    # labels[i] is the token at i+1 when that token is a target
    assert labels.tolist() == [
        [IGNORE, 20, EOS, IGNORE, IGNORE, IGNORE],
        [IGNORE, IGNORE, 21, 22, EOS, IGNORE],
    ]


def test_loss_is_global_token_mean_and_rank_split_invariant():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, 7, generator=g)
    labels = torch.full((4, 5), IGNORE)
    labels[0, 1:3] = torch.tensor([3, 4])
    labels[1, 0:4] = torch.tensor([1, 1, 2, 6])
    labels[3, 2] = 5
    # reference: mean over the 7 labelled positions of -log softmax
    logp = torch.log_softmax(logits, -1)
    pos = (labels != IGNORE).nonzero().tolist()
    ref = -sum(logp[b, t, labels[b, t]] for b, t in pos) / len(pos)
    assert sft_loss(logits, labels, num_global_targets=7).item() == pytest.approx(ref.item(), rel=1e-6)
    # two ranks with half the batch each: the mean of their losses is the same global mean
    halves = [sft_loss(logits[:2], labels[:2], 7, world_size=2), sft_loss(logits[2:], labels[2:], 7, world_size=2)]
    assert ((halves[0] + halves[1]) / 2).item() == pytest.approx(ref.item(), rel=1e-6)


def test_lr_schedule_values():
    assert [lr_factor(s, 10, 2, "constant") for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(2, 10, 2, "linear") == 1.0
    assert lr_factor(6, 10, 2, "linear") == pytest.approx(0.5)
    assert lr_factor(6, 10, 2, "cosine") == pytest.approx(0.5)
    assert lr_factor(4, 10, 2, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.25)))


def test_batch_schedule_is_seeded_epoch_permutations():
    s = batch_schedule(10, 4, 5, seed=1)
    assert [len(b) for b in s] == [4] * 5
    flat = np.concatenate(s)
    assert sorted(flat[:10].tolist()) == list(range(10))  # first epoch: each example once
    assert sorted(flat[10:20].tolist()) == list(range(10))
    assert all((a == b).all() for a, b in zip(s, batch_schedule(10, 4, 5, seed=1), strict=True))
    assert not all((a == b).all() for a, b in zip(s, batch_schedule(10, 4, 5, seed=2), strict=True))
    assert num_steps(100, 32, 1.0, None) == 4 and num_steps(100, 32, 2.5, None) == 8
    assert num_steps(100, 32, 1.0, 7) == 7
