"""Padding-free forward passes (stages/common/forward.py `pack(..., packed=True)`): the sequences of
a batch back to back in one row, position ids restarting at each, attention confined to each by
transformers. On every architecture of the architecture tests, packed log-probs, entropies,
values and gradients equal the padded ones within fp32 rounding where `packs` says the
architecture takes packed sequences, and `packs` says no exactly where they would not."""

from __future__ import annotations

import copy

import pytest
import torch
from architectures import ARCHITECTURES, build_model

from rlpipe.stages.common.forward import (
    PACKED_MODEL_TYPES,
    forward_batches,
    gather_positions,
    pack,
    packs,
    response_stats,
    teacher_forced_logprobs,
)
from rlpipe.stages.common.scalar_head import wrap

pytestmark = pytest.mark.architectures

# Long-tailed lengths, as a GRPO group's: one response runs long, others stop early; an episode's
# environment tokens (sampled 0) in the last.
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3, 4], [15, 16, 17, 18]]
RESPONSES = [[20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [31], [40, 41, 42], [43, 44, 45, 46, 47]]
SAMPLED = [[1.0] * 11, [1.0], [1.0] * 3, [1.0, 0.0, 0.0, 1.0, 1.0]]
# fp32 rounding: the two layouts sum attention and matmuls over other shapes and orders, a few
# ulps of the outputs (|log-prob| < 16 here, so 32 ulps of 16)
TOL = 32 * 16 * 2.0 ** -23


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def model(request, tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    return build_model(request.param, tok).eval()


@pytest.fixture(scope="module", params=[name for name in ARCHITECTURES if name in PACKED_MODEL_TYPES])
def packing_model(request, tiny_tokenizer):
    """A model of each architecture that takes packed sequences."""
    return build_model(request.param, copy.deepcopy(tiny_tokenizer)).eval()


def _stats(model, packed: bool):
    batch = pack(PROMPTS, RESPONSES, 0, sampled=SAMPLED, packed=packed)
    model.zero_grad()
    logp, entropy = response_stats(model, batch, chunk_tokens=4, entropy=True, entropy_grad=True)
    (logp.sum() + entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return batch, logp.detach(), entropy.detach(), grads


def test_packed_equals_padded_where_the_architecture_takes_packing(model):
    padded, logp, entropy, grads = _stats(model, packed=False)
    packed, plogp, pentropy, pgrads = _stats(model, packed=True)
    assert torch.equal(packed.mask, padded.mask)  # the episode's environment tokens masked in both
    assert packed.input_ids.numel() < padded.input_ids.numel()  # (fewer positions: no padding but a row end)
    same = (logp - plogp).abs().max().item() <= TOL and (entropy - pentropy).abs().max().item() <= TOL
    assert same == packs(model), (model.config.model_type, (logp - plogp).abs().max().item())
    if packs(model):
        for name, g in grads.items():  # gradients to the same rounding, relative to their scale
            assert (pgrads[name] - g).abs().max().item() <= TOL * max(g.abs().max().item(), 1.0), name


def test_values_of_a_scalar_head_packed_equal_padded(packing_model):
    from rlpipe.stages.common.scalar_head import backbone_of

    backbone, hidden = backbone_of(copy.deepcopy(packing_model))
    critic = wrap(backbone, hidden, "critic", init="normal", seed=0).eval()
    values = []
    for packed in (False, True):
        batch = pack(PROMPTS, RESPONSES, 0, packed=packed)
        with torch.no_grad():
            values.append(gather_positions(critic(**batch.model_inputs()).logits[..., 0].float(), batch))
    assert (values[0] - values[1]).abs().max().item() <= TOL


def test_packing_is_for_batches_it_shortens(tiny_policy_dir):
    """Sequences of one length are padded (packing leaves no fewer positions); one shorter and
    the whole pass packs, each of its forward batches (even one whose sequences are one length)."""
    from rlpipe.stages.common.forward import batched_packs, packing_shortens
    from rlpipe.stages.common.tiny import load_checkpoint

    assert not packing_shortens([5, 5, 5]) and packing_shortens([5, 4, 5]) and not packing_shortens([])
    model = load_checkpoint(tiny_policy_dir)[0]
    even = list(batched_packs(model, [[5, 6], [7, 8, 9]], [[20, 21, 22], [23, 24]], 0, batch_size=2))
    assert [b.attention_mask is None for b in even] == [False]
    uneven = list(batched_packs(model, [[5, 6], [7, 8, 9], [3]], [[20, 21, 22], [23, 24], [25]], 0, batch_size=2))
    assert [b.attention_mask is None for b in uneven] == [True, True]
    assert uneven[0].input_ids.tolist() == [[5, 6, 20, 21, 22], [7, 8, 9, 23, 24]]


def test_packed_architectures_are_the_tested_ones():
    assert PACKED_MODEL_TYPES <= set(ARCHITECTURES)  # (each checked by the tests above)


def test_forward_batches_by_rows_and_tokens():
    lengths = [5, 3, 9, 2, 2, 20, 1]
    assert forward_batches(lengths, max_rows=3) == [range(0, 3), range(3, 6), range(6, 7)]
    # at most 10 tokens each, in input order; the 20-token row alone
    assert forward_batches(lengths, max_rows=8, max_tokens=10) == [range(0, 2), range(2, 3), range(3, 5),
                                                                    range(5, 6), range(6, 7)]
    assert forward_batches([], max_rows=4, max_tokens=10) == []


def test_teacher_forced_logprobs_by_token_budget_equal_one_padded_batch(tiny_policy_dir):
    from rlpipe.stages.common.tiny import load_checkpoint

    model = load_checkpoint(tiny_policy_dir)[0]
    whole = teacher_forced_logprobs(model, PROMPTS, RESPONSES, 0, batch_size=8, packing=False)
    budget = teacher_forced_logprobs(model, PROMPTS, RESPONSES, 0, batch_size=8, max_tokens=12, packing=True)
    for a, b in zip(whole, budget, strict=True):
        assert a.shape == b.shape and abs(a - b).max() <= TOL


def test_sft_loss_and_gradients_packed_equal_padded(packing_model):
    """SFT's batches (stages/sft/core.py): packed rows give the padded rows' loss and gradients
    where the architecture takes packing."""
    from rlpipe.stages.sft.core import Example, collate, collate_packed, sft_loss

    examples = [Example([*p, *r], [False] * len(p) + [True] * len(r)) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    targets = sum(e.num_targets for e in examples)
    out = []
    for packed in (False, True):
        packing_model.zero_grad()
        if packed:
            ids, positions, labels = collate_packed(examples, 0)
            logits = packing_model(input_ids=ids, position_ids=positions, use_cache=False).logits
        else:
            ids, attention, labels = collate(examples, 0)
            logits = packing_model(input_ids=ids, attention_mask=attention).logits
        loss = sft_loss(logits, labels, targets)
        loss.backward()
        out.append((loss.item(), {n: p.grad.clone() for n, p in packing_model.named_parameters() if p.grad is not None}))
    (padded, grads), (packed, pgrads) = out
    assert abs(padded - packed) <= TOL and int((labels != -100).sum()) == targets
    for name, g in grads.items():
        assert (pgrads[name] - g).abs().max().item() <= TOL * max(g.abs().max().item(), 1.0), name


def test_rewards_packed_equal_padded(packing_model):
    """A reward model's score (the head at each sequence's last token), packed and padded."""
    from rlpipe.stages.common.scalar_head import backbone_of
    from rlpipe.stages.reward_model.modeling import reward_batch, sequence_rewards

    backbone, hidden = backbone_of(copy.deepcopy(packing_model))
    reward = wrap(backbone, hidden, "reward", init="normal", seed=0).eval()
    seqs = [[*p, *r] for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    with torch.no_grad():
        padded, packed = (sequence_rewards(reward, **reward_batch(seqs, 0, p)) for p in (False, True))
    assert padded.shape == (4,) and (padded - packed).abs().max().item() <= TOL


def _layout_by_hand(sequences, pad_id):
    """The layout PackedRows makes, the plain way: first-fit decreasing at each of the 17 widths,
    the fewest positions kept (the narrower on a tie), then each token written in a loop."""
    lengths = [len(q) for q in sequences]
    longest = max(lengths)
    best = None
    for width in sorted({longest + longest * k // 16 for k in range(17)}):
        fill, place = [], {}
        for b in sorted(range(len(lengths)), key=lambda b: (-lengths[b], b)):
            row = next((r for r, used in enumerate(fill) if used + lengths[b] <= width), len(fill))
            fill += [0] * (row == len(fill))
            place[b], fill[row] = (row, fill[row]), fill[row] + lengths[b]
        if best is None or len(fill) * width < len(best[1]) * best[0]:
            best = (width, fill, place)
    width, fill, place = best
    ids = [[pad_id] * width for _ in fill]
    positions = [[i - used if i >= used else 0 for i in range(width)] for used in fill]
    for b, q in enumerate(sequences):
        row, at = place[b]
        ids[row][at:at + len(q)], positions[row][at:at + len(q)] = list(q), list(range(len(q)))
    return [place[b][0] for b in range(len(sequences))], [place[b][1] for b in range(len(sequences))], ids, positions


def test_packed_rows_are_the_first_fit_layout_with_the_fewest_positions():
    """The pruned width search and the vectorised fill give what trying every width and writing
    every token in a loop gives, on long-tailed, equal and single-sequence batches."""
    import random

    from rlpipe.stages.common.forward import PackedRows

    rng = random.Random(0)
    cases = [[[7] * 5], [[3] * 4] * 6, [[1, 2, 3]] + [[4]] * 9]
    for _ in range(60):
        low = rng.randint(1, 20)
        cases.append([[rng.randint(0, 99) for _ in range(rng.randint(low, low + rng.randint(0, 50)))]
                      for _ in range(rng.randint(1, 90))])
    for sequences in cases:
        rows = PackedRows(sequences, pad_id=-1)
        row_of, start_of, ids, positions = _layout_by_hand(sequences, pad_id=-1)
        assert (rows.row_of, rows.start_of) == (row_of, start_of)
        assert rows.input_ids.tolist() == ids and rows.position_ids.tolist() == positions


def test_a_micro_batch_laid_out_at_once_is_the_row_by_row_layout():
    """`pack` writes every token in one pass: the padded rows, their attention mask and the
    response ids are what writing each row by hand gives, empty responses and episodes' masks of
    environment tokens included."""
    import random

    rng = random.Random(1)
    for _ in range(40):
        B = rng.randint(1, 30)
        prompts = [[rng.randint(1, 99) for _ in range(rng.randint(1, 12))] for _ in range(B)]
        responses = [[rng.randint(1, 99) for _ in range(rng.randint(0, 15))] for _ in range(B)]
        sampled = [[float(rng.random() < 0.7) for _ in r] for r in responses]
        L, T = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True)), max(len(r) for r in responses)
        ids, attention = [[-1] * L for _ in range(B)], [[0] * L for _ in range(B)]
        response_ids, mask = [[0] * T for _ in range(B)], [[0.0] * T for _ in range(B)]
        for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            ids[b][:len(p) + len(r)], attention[b][:len(p) + len(r)] = p + r, [1] * (len(p) + len(r))
            response_ids[b][:len(r)], mask[b][:len(r)] = r, sampled[b]
        for packed in (False, True):
            batch = pack(prompts, responses, -1, sampled=sampled, packed=packed)
            assert batch.response_ids.tolist() == response_ids and batch.mask.tolist() == mask
            if not packed:
                assert batch.input_ids.tolist() == ids and batch.attention_mask.tolist() == attention
