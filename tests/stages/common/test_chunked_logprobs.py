"""Log-probs and entropies without vocabulary-sized copies (`forward.response_stats`): the LM head on
the response positions only, a chunk of tokens at a time, each chunk recomputed in the backward.

On every architecture of the matrix (Gemma 2's final soft-capping included): the values of any chunk
size equal those of the unchunked formulas on the model's full logits (`response_logprobs`,
`response_entropy`) within the rounding of the head's matmul over other rows, and the gradients
within the reordering error of fp32 sums (both derived below); an episode's environment tokens get no log-prob and no gradient. The
old-log-prob pass computes no entropy. Memory itself is measured by benchmarks/bench_memory.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from architectures import ARCHITECTURES, build_model

from rlpipe.stages.common.forward import (
    final_hidden,
    output_head,
    pack,
    response_entropy,
    response_logprobs,
    response_stats,
)

pytestmark = pytest.mark.memory

EPS32 = torch.finfo(torch.float32).eps


def _batch(sampled=None):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 9, 3)]
    responses = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (7, 2, 11)]
    return pack(prompts, responses, 0, sampled=sampled)


def _value_tolerances(model, batch) -> tuple[float, float]:
    """How far log-probs and entropies may move when the head is applied to other rows.

    A logit z = h.w sums H products: computed over another set of rows (a matrix-vector product for
    a chunk of one) its rounding differs by at most d = H eps sum|h_i w_i| <= H eps |h| |w|
    (Cauchy-Schwarz). Then |d log p_v| <= 2d (the logit and the logsumexp), and the entropy
    -sum_v p_v log p_v moves by |sum_v p_v (1 + log p_v) d log p_v| <= 2d (1 + log V).
    """
    with torch.no_grad():
        hidden, weight = final_hidden(model, batch), output_head(model)[0].weight
        d = hidden.shape[-1] * EPS32 * float(hidden.norm(dim=-1).max()) * float(weight.norm(dim=-1).max())
    return 2 * d, 2 * d * (1 + math.log(weight.shape[0]))


def _grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


@pytest.mark.parametrize("entropy_grad", [True, False], ids=["entropy_bonus", "entropy_metric"])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_chunks_give_the_unchunked_values_and_gradients(name, entropy_grad, tiny_tokenizer):
    """With an entropy bonus the gradient goes through autograd's log-softmax; with the entropy a
    metric (optimize's default) through `_TokenLogprob`'s own backward: both against autograd's on
    the full logits."""
    model = build_model(name, tiny_tokenizer).eval()
    batch = _batch()
    bonus = 0.1 if entropy_grad else 0.0
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp, ent = response_logprobs(logits, batch), response_entropy(logits, batch)
    (logp.sum() + bonus * ent.sum()).backward()
    reference = _grads(model)
    # A gradient entry sums one term per position; the chunked path sums the response positions'
    # only, in another order: fp32 reordering error <= n eps sum|terms|, n = B x L positions. The
    # terms are bounded by the model's largest gradient entry G (an entry whose exact value cancels
    # to 0, such as an attention key bias's, sums terms of the others' size): tolerance n eps G.
    n = batch.input_ids.numel()
    grad_tol = n * EPS32 * max(float(g.abs().max()) for g in reference.values())
    logp_tol, ent_tol = _value_tolerances(model, batch)
    for chunk in (None, 1, 4, 10_000):
        got_logp, got_ent = response_stats(model, batch, chunk_tokens=chunk, entropy_grad=entropy_grad)
        assert got_ent.requires_grad == entropy_grad
        assert float((got_logp - logp).abs().max().detach()) <= logp_tol, chunk
        assert float((got_ent - ent).abs().max().detach()) <= ent_tol, chunk
        (got_logp.sum() + bonus * got_ent.sum()).backward()
        grads = _grads(model)
        assert grads.keys() == reference.keys()
        for key, want in reference.items():
            assert float((grads[key] - want).abs().max()) <= grad_tol, (chunk, key)


def test_environment_tokens_get_no_logprob_and_no_gradient(tiny_tokenizer):
    """Masked tokens (an episode's environment) are left out of the chunks: zero values, and a loss
    on them alone moves nothing."""
    model = build_model("llama", tiny_tokenizer).eval()
    sampled = [[1, 1, 0, 0, 1, 1, 1], [0, 0], [1] * 11]
    batch = _batch(sampled)
    logp, ent = response_stats(model, batch, chunk_tokens=3, entropy_grad=True)
    masked = batch.mask == 0
    assert torch.equal(logp[masked], torch.zeros(int(masked.sum()))) and torch.equal(ent[masked], logp[masked])
    full = _batch()
    want = response_logprobs(model(input_ids=full.input_ids, attention_mask=full.attention_mask).logits, full)
    assert float((logp - want * batch.mask).abs().max().detach()) <= _value_tolerances(model, full)[0]
    (logp * masked).sum().backward()  # a loss that reads only masked tokens
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_the_old_logprob_pass_takes_no_entropy_and_no_gradient_through_entropy(tiny_tokenizer):
    model = build_model("qwen2", tiny_tokenizer).eval()
    batch = _batch()
    logp, ent = response_stats(model, batch, chunk_tokens=4, entropy=False)
    assert ent is None and logp.shape == batch.mask.shape
    _, detached = response_stats(model, batch, chunk_tokens=4)
    assert not detached.requires_grad  # entropy_grad False: a metric, not a loss term


def test_bf16_chunks_equal_the_unchunked_bf16_path_within_bf16_rounding(tiny_tokenizer):
    """In bf16 the head's logits are rounded to bf16 (eps 2^-8) before the fp32 softmax, in either
    path; the head is applied to other rows, so each logit may round differently by one bf16 ulp of
    its magnitude: log-probs and entropies differ by at most ~2 ulp x max|z|."""
    model = build_model("llama", tiny_tokenizer).eval().to(torch.bfloat16)
    batch = _batch()
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp, ent = response_logprobs(logits, batch), response_entropy(logits, batch)
    got_logp, got_ent = response_stats(model, batch, chunk_tokens=4)
    tol = 2 * torch.finfo(torch.bfloat16).eps * float(logits.float().abs().max())
    assert float((got_logp - logp).abs().max()) <= tol and float((got_ent - ent).abs().max()) <= tol


def test_the_logprob_backward_is_autograds_bit_for_bit():
    """`_TokenLogprob` writes d logp / dz = onehot(a) g - softmax(z) g in one tensor: the same
    products and sums as autograd's logsumexp and gather backward, so the same bits."""
    from rlpipe.stages.common.forward import _TokenLogprob

    g = torch.Generator().manual_seed(0)
    z = torch.randn(64, 5000, generator=g) * 4
    ids = torch.randint(0, 5000, (64,), generator=g)
    weights = torch.randn(64, generator=g)
    by_autograd = z.clone().requires_grad_()
    want = by_autograd.gather(-1, ids[:, None]).squeeze(-1) - torch.logsumexp(by_autograd, dim=-1)
    (want * weights).sum().backward()
    ours = z.clone().requires_grad_()
    got, _ = _TokenLogprob.apply(ours, ids)
    (got * weights).sum().backward()
    assert torch.equal(got, want) and torch.equal(ours.grad, by_autograd.grad)
