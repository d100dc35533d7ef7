"""Peak memory of the steps that hold vocabulary-sized tensors, with the change off and on.

    python benchmarks/bench_memory.py [--json FILE] [--tokens 1024] [--chunk 256]

Each case runs in a child process of its own; "extra" is the peak resident memory (the kernel's
high-water mark, VmHWM) above what the process held just before the step, in MB.

logprob_entropy: the forward and backward of log-probs plus entropy exactly as optimize runs them
(entropy as a metric, no gradient), on a tiny Llama (hidden 64, 2 layers) with Qwen2.5's
151,936-token vocabulary, 2 rows x 1,024 response tokens after 16 prompt tokens, fp32 on CPU:
    before  the model's full (B, L, V) logits, then `response_logprobs` and `response_entropy` on
            them (the fp32 copies of the response positions' logits);
    after   `response_stats` with `logprob_chunk_tokens` = --chunk (the LM head on the response
            positions only, a chunk at a time, recomputed in the backward);
    floor   the same forward and backward with a loss on the final hidden states: what any
            log-prob computation holds (the activations), with nothing vocabulary-sized.
Larger shapes by formula: the before path's extra grows as 4 x B x T x V x 4 bytes (+ the logits,
B x L x V x dtype bytes); the after path's as the floor plus one chunk, about 5 x chunk x V x 4 bytes ("chunk_mb": a chunk's
backward holds its recomputed logits, their softmax, the incoming gradient's product with it and the
logits' gradient; its forward three such tensors).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

VOCAB = 151_936


def _rss_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process, in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    """Start the high-water mark again from the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def child(case: str, tokens: int, chunk: int) -> dict[str, float]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlpipe.stages.common.forward import (
        final_hidden,
        pack,
        response_entropy,
        response_logprobs,
        response_stats,
    )

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                                         max_position_embeddings=tokens + 64))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VOCAB, (16,), generator=g).tolist() for _ in range(2)]
    responses = [torch.randint(1, VOCAB, (tokens,), generator=g).tolist() for _ in range(2)]
    batch = pack(prompts, responses, 0)
    if case == "floor":  # warm-up of the allocator and kernels on a small batch, as for the others
        final_hidden(model, pack(prompts, [r[:8] for r in responses], 0)).sum().backward()
    model.zero_grad(set_to_none=False)  # gradients allocated before the step: not the step's memory
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    held = _rss_mb("VmRSS")
    _reset_peak()
    if case == "before":
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logp = response_logprobs(logits, batch)
        with torch.no_grad():
            entropy = response_entropy(logits.detach(), batch)
        (logp.sum() + 0 * entropy.sum()).backward()
    elif case == "after":
        logp, entropy = response_stats(model, batch, chunk_tokens=chunk)
        (logp.sum() + 0 * entropy.sum()).backward()
    else:
        final_hidden(model, batch).float().pow(2).mean().backward()
    return {"extra_mb": _rss_mb("VmHWM") - held}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=1024, help="response tokens per row (2 rows)")
    parser.add_argument("--chunk", type=int, default=256, help="logprob_chunk_tokens of the after case "
                        "(default: the knob's default)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.chunk)))
        return 0
    got = {}
    for case in ("before", "after", "floor"):
        out = subprocess.run([sys.executable, __file__, "--child", case, "--tokens", str(args.tokens),
                              "--chunk", str(args.chunk)], capture_output=True, text=True, check=True)
        got[case] = json.loads(out.stdout.strip().splitlines()[-1])["extra_mb"]
    chunk_mb = 5 * args.chunk * VOCAB * 4 / 2**20
    figures = {"logprob_entropy": {"extra_before_mb": round(got["before"], 1), "extra_after_mb": round(got["after"], 1),
                                   "floor_mb": round(got["floor"], 1), "chunk_mb": round(chunk_mb, 1),
                                   "rows": 2, "response_tokens": args.tokens, "vocab": VOCAB,
                                   "chunk_tokens": args.chunk}}
    f = figures["logprob_entropy"]
    print(f"logprob_entropy (2 rows x {args.tokens} response tokens, V = {VOCAB}, fp32, chunk {args.chunk}):")
    print(f"  extra before {f['extra_before_mb']:.0f} MB, after {f['extra_after_mb']:.0f} MB "
          f"({f['extra_before_mb'] / max(f['extra_after_mb'], 1e-9):.1f}x lower), floor {f['floor_mb']:.0f} MB, "
          f"one chunk ~{chunk_mb:.0f} MB: after - floor = {f['extra_after_mb'] - f['floor_mb']:.0f} MB")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
