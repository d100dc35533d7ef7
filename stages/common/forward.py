"""Teacher-forced forward passes over (prompt, response) token sequences: the one place where
per-token log-probs, entropies and values of responses are gathered.

Notation: B sequences; sequence b is prompt tokens p_b (length P_b) followed by response tokens
a_b (length T_b), right-padded to a common length L. The log-prob of response token t is read from
the logits at position P_b + t - 1 (the position that predicts it):

    logp[b, t] = logits[b, P_b + t - 1, a_{b,t}] - logsumexp(logits[b, P_b + t - 1, :])

Outputs are left-aligned per response, shape (B, T) with T = max_b T_b, and `mask[b, t] = 1` on
real response tokens. Right padding needs no position ids (pads come after every real token).

Packed (`pack(..., packed=True)`): the B sequences lie back to back in R <= B rows (`PackedRows`:
as wide as the longest, or up to twice that where fewer positions stay empty; padding only at a
row's end), position ids restarting at 0 at each sequence; transformers reads restarting position
ids with no attention mask as packed sequences and confines attention to each (a block-diagonal
causal mask for sdpa / eager / flex, flash-attention's variable-length kernel), so every
sequence's logits are those of its own forward. Dense attention (CPU, sdpa) costs each row
width^2, at most twice the padded layout's; one row of every token would cost (sum_b L_b)^2. The
outputs keep their (B, T) shape: `rows[b]` and `positions[b, t]` say where each response position is.

Memory (`response_stats`): the model's forward keeps one position's logits (`logits_to_keep=1`);
the LM head is applied to the response positions' final hidden states only, `chunk_tokens` tokens
at a time, each chunk's fp32 logits recomputed in the backward instead of kept (activation
checkpointing of the head), and the log-probs' backward writes the logits' gradient in one tensor
(`_TokenLogprob`), so the extra memory of log-probs and entropy is about two (chunk_tokens, V)
fp32 tensors and the head's weight gradient (a chunk's backward), not the logits and four
(B, T, V) fp32 copies (benchmarks/bench_memory.py: 16x lower at 2 x 1,024 tokens and V = 151,936).
One chunk of every token is the unchunked computation (nothing recomputed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils.checkpoint

from rlpipe.stages.common import LOGPROB_CHUNK_TOKENS

#: Architectures whose forward reads restarting position ids without an attention mask as packed
#: sequences (transformers' masking_utils), checked packed against padded on tiny checkpoints of
#: each (tests/stages/common/test_packing.py). OPT (positions from the mask's running sum) and Bloom
#: (ALiBi from the mask) are not; an architecture not listed is padded.
PACKED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3", "gpt2", "gpt_neox",
                                "qwen2_moe", "mixtral", "olmoe"})


def packs(model: Any) -> bool:
    """Whether `model` (a DeepSpeed engine's, a scalar-head model's backbone, a LoRA wrapper's
    base) takes packed sequences (`PACKED_MODEL_TYPES`)."""
    inner = getattr(model, "module", model)
    inner = getattr(inner, "backbone", inner)
    return getattr(getattr(inner, "config", None), "model_type", None) in PACKED_MODEL_TYPES


def packing_shortens(lengths: Sequence[int]) -> bool:
    """Whether packing sequences of these lengths (a whole batch's, decided once for all its
    micro-batches, so a split of it never changes a sequence's layout) leaves fewer positions than
    padding them: some is shorter than the longest. Sequences of one length are padded instead:
    the same positions, under a plain causal mask (sdpa's fused causal kernel) rather than a
    block-diagonal one (a 1m Llama's forward and backward over 128 rows of 12 tokens on one CPU
    thread, timed alone: padded 3-7% faster; docs/cluster.md#scale-cost)."""
    return len(set(lengths)) > 1


@dataclass(frozen=True)
class PackedBatch:
    """Prompt+response sequences packed for one forward pass.

    Shapes: input_ids (R, L) (R = B padded, R <= B packed); attention_mask (B, L) padded, None
    packed; position_ids None padded, (R, L) packed; positions, mask (B, T); prompt_lens,
    response_lens, rows (B,).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    positions: torch.Tensor
    """positions[b, t]: where in row rows[b] the logits that predict response token t sit (P_b + t - 1
    from the sequence's start)."""
    mask: torch.Tensor
    """1.0 on real response tokens, 0.0 on padding (float32)."""
    response_ids: torch.Tensor
    """Response token ids, left-aligned, padded with 0 (B, T)."""
    prompt_lens: torch.Tensor
    response_lens: torch.Tensor
    rows: torch.Tensor
    """The row of input_ids each sequence lies in (b padded)."""
    position_ids: torch.Tensor | None = None
    """Packed: each token's position in its own sequence (restarting at 0); None padded."""

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(*(None if (x := getattr(self, f)) is None else x.to(device) for f in self.__dataclass_fields__))

    def model_inputs(self) -> dict[str, torch.Tensor | None]:
        """The keyword arguments of the model's forward for this layout."""
        if self.position_ids is None:
            return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        # (no cache: transformers reads restarting position ids as packed sequences only without one)
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}

    @property
    def tokens(self) -> int:
        """Positions the forward computes (padding included)."""
        return self.input_ids.numel()


def pack(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int,
         sampled: Sequence[Sequence[float]] | None = None, *, packed: bool = False) -> PackedBatch:
    """Concatenate each prompt with its response and right-pad to one length, or (`packed`) lay
    them back to back in rows without padding but a row's end (`PackedRows`, the module doc).

    `sampled` (episodes): per response token 1 where the model sampled it, 0 where an environment
    wrote it; `mask` is then 0 on the environment's tokens too, so that no log-prob, entropy or
    loss term is taken over them (they stay in the input: later tokens are conditioned on them).
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("a prompt has no tokens: the first response token would have no context")
    B = len(prompts)
    P = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    T_b = torch.tensor([len(r) for r in responses], dtype=torch.long)
    T = int(T_b.max()) if B else 0
    t = torch.arange(T).unsqueeze(0)
    mask = (t < T_b.unsqueeze(1)).float()
    # (every token written in one pass: a tensor write per row cost milliseconds a batch, while a
    # GPU waits for the batch)
    response_ids = torch.zeros((B, T), dtype=torch.long)
    response_ids[mask > 0] = concatenated(responses, int(T_b.sum()))
    sequences = [[*p, *r] for p, r in zip(prompts, responses, strict=True)]
    if packed:
        rows = PackedRows(sequences, pad_id)
        starts = torch.tensor(rows.start_of, dtype=torch.long)
        positions = (starts.unsqueeze(1) + P.unsqueeze(1) + t - 1) * mask.long()
        batch = PackedBatch(rows.input_ids, None, positions, mask, response_ids, P, T_b,
                            torch.tensor(rows.row_of, dtype=torch.long), rows.position_ids)
    else:
        L = int((P + T_b).max()) if B else 0
        attention_mask = (torch.arange(L).unsqueeze(0) < (P + T_b).unsqueeze(1)).long()
        input_ids = torch.full((B, L), pad_id, dtype=torch.long)
        input_ids[attention_mask > 0] = concatenated(sequences, int(attention_mask.sum()))
        positions = (P.unsqueeze(1) + t - 1).clamp(max=max(L - 1, 0)) * mask.long()
        batch = PackedBatch(input_ids, attention_mask, positions, mask, response_ids, P, T_b, torch.arange(B))
    if sampled is not None:
        for b, m in enumerate(sampled):
            mask[b, : len(m)] *= torch.as_tensor(np.asarray(m, dtype=np.float32))
    return batch


def concatenated(sequences: Sequence[Sequence[int]], total: int) -> torch.Tensor:
    """Every token of `sequences` (`total` of them), one after another, as one int64 tensor."""
    return torch.from_numpy(np.fromiter((t for q in sequences for t in q), dtype=np.int64, count=total))


class PackedRows:
    """Token sequences laid back to back in rows as wide as the longest, or up to twice that where
    it leaves fewer positions empty (first-fit decreasing: padding only at a row's end), position
    ids restarting at each sequence and at a row's trailing padding (a segment of its own): what
    transformers reads as packed sequences. Attention (dense on CPU) costs each row width^2: at
    most twice what padding the rows would cost, and one row of every token would cost the square
    of their sum.

    Shapes: input_ids, position_ids (R, width); row_of, start_of: one per sequence."""

    def __init__(self, sequences: Sequence[Sequence[int]], pad_id: int):
        lengths = [len(q) for q in sequences]
        longest = max(lengths, default=0)
        # rows as wide as the longest sequence, or up to twice that where fewer positions are left
        # empty (first-fit leaves a row's end empty when no sequence fits it): 17 widths tried
        width, (self.row_of, self.start_of, fill) = _fewest_positions(lengths, longest)
        # every token's place in the flattened (R, width) rows: its sequence's start plus its
        # position, in one numpy pass (a Python loop of tensor writes cost milliseconds a batch)
        n = np.asarray(lengths, dtype=np.int64)
        first = np.cumsum(n) - n  # each sequence's first token in the concatenation
        position = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(first, n)
        start = np.asarray(self.row_of, dtype=np.int64) * width + np.asarray(self.start_of, dtype=np.int64)
        place = np.repeat(start, n) + position
        ids = np.full(len(fill) * width, pad_id, dtype=np.int64)
        ids[place] = concatenated(sequences, len(place)).numpy()
        # a row's trailing padding is a segment of its own, its positions from 0
        positions = np.tile(np.arange(width, dtype=np.int64), len(fill)) - np.repeat(np.asarray(fill), width)
        positions[place] = position
        self.input_ids = torch.from_numpy(ids.reshape(len(fill), width))
        self.position_ids = torch.from_numpy(positions.reshape(len(fill), width))


def _fewest_positions(lengths: list[int], longest: int) -> tuple[int, tuple[list[int], list[int], list[int]]]:
    """Of the widths longest x (1 + k/16), k = 0..16, the one whose first-fit layout has the fewest
    positions (rows x width; the narrower on a tie), and that layout. A width's layout cannot take
    fewer than ceil(total / width) x width positions: widths are tried in the order of that bound
    and no further once it exceeds the best found (the same choice as trying all 17)."""
    total = sum(lengths)
    bound = {w: -(-total // max(w, 1)) * w for w in {longest + longest * k // 16 for k in range(17)}}
    longest_first = sorted(range(len(lengths)), key=lambda b: (-lengths[b], b))  # (the same for every width)
    best: tuple[int, int, Any] | None = None
    for w in sorted(bound, key=lambda w: (bound[w], w)):
        if best is not None and (bound[w], w) > best[:2]:
            break
        layout = _first_fit(lengths, w, longest_first)
        cost = len(layout[2]) * w
        if best is None or (cost, w) < best[:2]:
            best = (cost, w, layout)
    assert best is not None
    return best[1], best[2]


def _first_fit(lengths: list[int], width: int,
               longest_first: Sequence[int] | None = None) -> tuple[list[int], list[int], list[int]]:
    """First-fit decreasing of sequences of `lengths` into rows of `width`: (row of each, start of
    each, each row's fill). Rows with less room than the shortest sequence are passed over for
    good (`open_rows`, in row order). `longest_first`: the sequences by decreasing length (ties by
    index), when the caller has it."""
    fill: list[int] = []
    open_rows: list[int] = []
    shortest = min(lengths, default=0)
    row_of, start_of = [0] * len(lengths), [0] * len(lengths)
    if longest_first is None:
        longest_first = sorted(range(len(lengths)), key=lambda b: (-lengths[b], b))
    for b in longest_first:
        n = lengths[b]
        room = width - n
        for r in open_rows:  # the first open row it fits in, else a new one
            if fill[r] <= room:
                break
        else:
            fill.append(0)
            open_rows.append(r := len(fill) - 1)
        row_of[b], start_of[b] = r, fill[r]
        fill[r] += n
        if fill[r] + shortest > width:
            open_rows.remove(r)
    return row_of, start_of, fill


def gather_positions(x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """x[rows[b], positions[b, t]] for a per-position tensor x of shape (R, L), (B, T); zero where masked."""
    return x[batch.rows.unsqueeze(1), batch.positions] * batch.mask


def response_logprobs(logits: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """log pi(a_t | prefix) of each response token, (B, T); differentiable; 0 where masked.

    Gathers the needed positions before the softmax, so memory is O(B*T*V), not O(B*L*V).
    """
    picked = logits[batch.rows.unsqueeze(1), batch.positions].float()  # (B, T, V)
    token_logits = picked.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    return (token_logits - torch.logsumexp(picked, dim=-1)) * batch.mask


def response_entropy(logits: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """H_t = -sum_a pi(a) log pi(a) at each response position, (B, T); 0 where masked."""
    logp = torch.log_softmax(logits[batch.rows.unsqueeze(1), batch.positions].float(), dim=-1)
    return -(logp.exp() * logp).sum(-1) * batch.mask


def output_head(model: Any) -> tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """The model's output layer and what its forward does to the layer's output: the logit scale
    (Cohere: `logit_scale`), the division (Granite: `logits_scaling`) and the final soft-capping
    (Gemma 2 and 3: `final_logit_softcapping`), in that order, as transformers applies them."""
    inner = getattr(model, "module", model)  # a DeepSpeed engine's model
    config = inner.config
    scale = getattr(config, "logit_scale", None)
    divide = getattr(config, "logits_scaling", None)
    cap = getattr(config, "final_logit_softcapping", None)

    def finish(logits: torch.Tensor) -> torch.Tensor:
        if scale is not None:
            logits = logits * scale
        if divide is not None:
            logits = logits / divide
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap  # z -> c tanh(z / c)
        return logits

    return inner.get_output_embeddings(), finish


def final_hidden(model: Any, batch: PackedBatch) -> torch.Tensor:
    """The final hidden states (R, L, H) the output layer reads, with no full-length logits: the
    forward computes one position's (`logits_to_keep=1`)."""
    out = model(**batch.model_inputs(), output_hidden_states=True, logits_to_keep=1)
    return out.hidden_states[-1]


class _TokenLogprob(torch.autograd.Function):
    """log pi(a) = z_a - logsumexp(z) of N tokens from their fp32 logits z (N, V), with the
    gradient written in one (N, V) tensor:

        d logp_n / d z_nv = [v = a_n] - pi_nv,   so   grad_z = onehot(a) * g - softmax(z) * g

    Autograd's own backward holds four (N, V) tensors beside z (the softmax, each branch's gradient
    and their sum); this one holds one, and saves z itself (no copy), so a chunk's backward through
    the LM head holds the recomputed logits and their gradient. The values are autograd's: the same
    products and sums, each element's two terms added in the same order."""

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lse = torch.logsumexp(z, dim=-1)
        ctx.save_for_backward(z, ids, lse)
        return z.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - lse, lse

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, grad_lse: torch.Tensor) -> tuple[torch.Tensor, None]:
        z, ids, lse = ctx.saved_tensors
        # d/dz of g (z_a - lse) + g' lse: softmax(z) (g' - g), then + g at a
        weight = (grad_lse - grad) if grad_lse is not None else -grad
        grad_z = (z - lse.unsqueeze(-1)).exp_().mul_(weight.unsqueeze(-1))
        grad_z.scatter_add_(-1, ids.unsqueeze(-1), grad.unsqueeze(-1))
        return grad_z, None


def _chunk_stats(hidden: torch.Tensor, ids: torch.Tensor, head: torch.nn.Module,
                 finish: Callable[[torch.Tensor], torch.Tensor], entropy: bool,
                 entropy_grad: bool) -> tuple[torch.Tensor, ...]:
    """log pi(a) and H of N tokens from their hidden states (N, H): fp32 over the vocabulary.

        logp = z_a - logsumexp(z),   H = -sum_v pi_v log pi_v,   log pi = z - logsumexp(z)

    Beyond the logits, the backward holds their gradient (`_TokenLogprob`) and the metric entropy
    `ENTROPY_ROWS` tokens' log pi at a time (no graph). An entropy with gradient (an entropy bonus)
    goes through autograd: log pi and its terms are kept for it.
    """
    z = finish(head(hidden).float())  # (N, V)
    logp, lse = _TokenLogprob.apply(z, ids)
    if not entropy:
        return (logp,)
    if entropy_grad and torch.is_grad_enabled():
        log_pi = z - lse.unsqueeze(-1)
        return logp, -(log_pi.exp() * log_pi).sum(-1)
    with torch.no_grad():
        z, lse = z.detach(), lse.detach()
        parts = []
        for start in range(0, len(z), ENTROPY_ROWS):
            log_pi = z[start:start + ENTROPY_ROWS] - lse[start:start + ENTROPY_ROWS].unsqueeze(-1)
            parts.append(-log_pi.exp().mul_(log_pi).sum(-1))
        return logp, torch.cat(parts) if parts else lse.new_zeros(0)


#: Tokens whose metric entropy is computed at once (`_chunk_stats`): two (ENTROPY_ROWS, V) fp32
#: tensors, 39 MB at V = 151,936, small beside a chunk's logits.
ENTROPY_ROWS = 32


def response_stats(model: Any, batch: PackedBatch, *, chunk_tokens: int | None = LOGPROB_CHUNK_TOKENS,
                   entropy: bool = True, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs, entropies) of the response tokens, each (B, T) fp32, 0 where masked; the
    entropy None unless asked, with gradient only when `entropy_grad`. `chunk_tokens` None: one
    chunk of all tokens (nothing recomputed in the backward)."""
    hidden = final_hidden(model, batch)
    B, T = batch.mask.shape
    where = (batch.mask.reshape(-1) > 0).nonzero().squeeze(-1)  # the tokens a log-prob is taken of
    picked = hidden[batch.rows.unsqueeze(1), batch.positions].reshape(B * T, -1)[where]  # (N, H)
    ids = batch.response_ids.reshape(-1)[where]
    head, finish = output_head(model)
    size = max(len(ids) if chunk_tokens is None else chunk_tokens, 1)
    chunks = max(1, -(-len(ids) // size))
    if _partitioned(head):  # ZeRO-3: each call of the head gathers its weight with every rank's
        chunks = _most_over_ranks(chunks, picked.device)  # so all make as many (some empty)
    recompute = chunks > 1 and torch.is_grad_enabled() and picked.requires_grad
    parts = []
    for start in range(0, chunks * size, size):
        args = (picked[start:start + size], ids[start:start + size], head, finish, entropy, entropy_grad)
        parts.append(torch.utils.checkpoint.checkpoint(_chunk_stats, *args, use_reentrant=False)
                     if recompute else _chunk_stats(*args))
    out = []
    for i in range(2 if entropy else 1):
        flat = torch.cat([p[i] for p in parts]) if parts else picked.new_zeros(0, dtype=torch.float32)
        full = torch.zeros(B * T, dtype=torch.float32, device=picked.device).index_put((where,), flat)
        out.append(full.reshape(B, T) * batch.mask)
    return out[0], (out[1] if entropy else None)


def _partitioned(module: torch.nn.Module) -> bool:
    """Whether ZeRO-3 partitions the module's parameters over ranks (DeepSpeed marks them)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def _most_over_ranks(n: int, device: torch.device) -> int:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return n
    most = torch.tensor([n], dtype=torch.long, device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most)


def unpad(x: torch.Tensor, batch: PackedBatch) -> list[np.ndarray]:
    """Split a (B, T) tensor into per-sequence float32 arrays of length T_b."""
    x = x.detach().float().cpu().numpy()
    return [x[b, : int(n)].astype(np.float32) for b, n in enumerate(batch.response_lens)]


def forward_batches(lengths: Sequence[int], max_rows: int, max_tokens: int | None = None) -> list[range]:
    """Consecutive rows for each forward pass, in input order: at most `max_rows` rows and (when
    given) `max_tokens` tokens each; a row longer than the budget goes alone."""
    out: list[range] = []
    start, tokens = 0, 0
    for i, n in enumerate(lengths):
        if i > start and (i - start >= max_rows or (max_tokens is not None and tokens + n > max_tokens)):
            out.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    if start < len(lengths):
        out.append(range(start, len(lengths)))
    return out


def batched_packs(model: Any, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int,
                  batch_size: int, max_tokens: int | None = None, packing: bool = True) -> Iterator[PackedBatch]:
    """The forward passes of a no-grad pass over (prompt, response) rows in input order
    (`forward_batches`), packed where the model takes it (`packs`) and it shortens them
    (`packing_shortens`), on the model's device."""
    device = next(model.parameters()).device
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    packed = packing and packs(model) and packing_shortens(lengths)
    for rows in forward_batches(lengths, batch_size, max_tokens):
        yield pack([prompts[i] for i in rows], [responses[i] for i in rows], pad_id, packed=packed).to(device)


@torch.no_grad()
def teacher_forced_logprobs(model, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                            pad_id: int, batch_size: int = 32, chunk_tokens: int | None = LOGPROB_CHUNK_TOKENS,
                            max_tokens: int | None = None, packing: bool = True) -> list[np.ndarray]:
    """Per-token log-probs of each response under `model` (no grad), in input order; forward
    passes of `batch_size` rows and at most `max_tokens` tokens, packed where the model takes it."""
    out: list[np.ndarray] = []
    for batch in batched_packs(model, prompts, responses, pad_id, batch_size, max_tokens, packing):
        out.extend(unpad(response_stats(model, batch, chunk_tokens=chunk_tokens, entropy=False)[0], batch))
    return out
