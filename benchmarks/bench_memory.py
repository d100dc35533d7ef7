"""Peak memory of the steps that hold vocabulary-, batch- or model-sized tensors, with the change
off and on.

    python benchmarks/bench_memory.py [--json FILE] [--tokens 1024] [--chunk 256] [--cases ...]

Each case runs in a child process of its own (glibc's mmap threshold held at 128 KiB, so freed large
blocks leave the resident set); "extra" is the peak resident memory (the kernel's high-water mark,
VmHWM) above what the process held just before the step, in MB.

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
B x L x V x dtype bytes); the after path's stays the floor plus one chunk, (2 x chunk x V + V x H) x 4
bytes ("chunk_mb": a chunk's backward holds its recomputed logits, their gradient, and the LM head's
weight gradient from that chunk before it is added to the parameter's).

reference_batch: the reference stage's no-grad log-prob pass (`teacher_forced_logprobs`, packed) over
64 rows whose responses are long-tailed as sampled ones are (56 of 48 tokens, 8 of 1,536), on a
small Llama (hidden 256, 4 heads, 2 layers, Llama 2's 32,000-token vocabulary):
    before  `reference.batch_size` 32 rows per pass whatever their lengths (the pass holding the
            long rows holds ~13k tokens);
    after   with `reference.max_tokens_per_batch` 4,096 beside it;
    floor   the longest row alone (what any batching holds).

zero3_save_80m: a 2-rank ZeRO-3 engine (gloo, fp32) of `base_model.size=80m` (~83M parameters)
saving its policy; the extra peak per rank:
    before  every parameter gathered at once (DeepSpeed's GatheredParameters over the model, as the
            save did): the whole model on every rank;
    after   `deepspeed.save_pretrained`: a module at a time, each parameter's partitions gathered
            to rank 0 alone (`gathered_by_module`); rank 0 builds the host copy it writes from (the
            model's size: `host_copy_mb`, reported on its own), rank 1 only sends its partitions;
    shared  `partitioned_handoff.hand_over` (a resident optimize's hand-over to the weight channel
            from its second save on), the files cut at 40 MB (`optimize.max_shard_size`): each rank
            gathers, hashes and writes only the weight files it owns (about half the model each);
    largest_layer_mb  the largest module's parameters (the most one gather holds); floor_mb the same.

offload (not run by default: for a GPU, `--cases offload`, benchmarks/gpu_figures.sh): one rank's
ZeRO-3 engine of `base_model.size=--offload-size` (1b: ~0.97B parameters), bf16 with fp32 masters
on a GPU, taking an optimizer step on 2 rows x 512 tokens with the optimizer state off-loaded to
host memory or not, and the parameters too; the device's memory held before the step and its peak
during it (`torch.cuda.max_memory_allocated`; on a CPU the resident set, where offloading moves
nothing), and the step's seconds. The step measured is the second (the first makes the state).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

VOCAB = 151_936
HIDDEN = 64  # (logprob_entropy's Llama)


def _rss_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process, in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    """Start the high-water mark again from the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def child(case: str, tokens: int, chunk: int, size: str = "1b") -> dict[str, float]:
    if case.startswith("offload_"):
        return offload_child(case.removeprefix("offload_"), size)
    if case.startswith("reference_"):
        return reference_child(case.removeprefix("reference_"))
    if case.startswith("zero3_"):
        return zero3_child(case.removeprefix("zero3_"))
    import torch

    from rlpipe.stages.common.forward import (
        final_hidden,
        pack,
        response_entropy,
        response_logprobs,
        response_stats,
    )

    model = _llama(tokens + 64, hidden=HIDDEN, heads=2, vocab=VOCAB)
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


def _llama(positions: int, hidden: int, heads: int, vocab: int):
    """A seeded 2-layer Llama (one key/value head), built at one torch thread."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(1)
    return LlamaForCausalLM(LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                                        num_attention_heads=heads, num_key_value_heads=1, vocab_size=vocab,
                                        max_position_embeddings=positions))


def reference_child(variant: str) -> dict[str, float]:
    import torch

    from rlpipe.stages.common.forward import teacher_forced_logprobs

    model = _llama(2048, hidden=256, heads=4, vocab=REFERENCE_VOCAB).eval()
    g = torch.Generator().manual_seed(0)
    lengths = [1536 if i % 8 == 3 else 48 for i in range(64)]  # (the long ones spread over both batches)
    prompts = [torch.randint(1, REFERENCE_VOCAB, (16,), generator=g).tolist() for _ in lengths]
    responses = [torch.randint(1, REFERENCE_VOCAB, (n,), generator=g).tolist() for n in lengths]
    teacher_forced_logprobs(model, prompts[:2], [r[:8] for r in responses[:2]], 0)  # warm-up
    if variant == "floor":
        longest = max(range(len(lengths)), key=lambda i: lengths[i])
        prompts, responses = [prompts[longest]], [responses[longest]]
    held = _rss_mb("VmRSS")
    _reset_peak()
    teacher_forced_logprobs(model, prompts, responses, 0, batch_size=32,
                            max_tokens=REFERENCE_BUDGET if variant == "after" else None)
    return {"extra_mb": _rss_mb("VmHWM") - held}


#: reference_batch's token budget per pass (`reference.max_tokens_per_batch`) and vocabulary (Llama 2's:
#: a log-prob chunk of 256 tokens is then 33 MB, so what a pass holds is the batch's, not the chunk's)
REFERENCE_BUDGET = 4096
REFERENCE_VOCAB = 32_000


#: zero3_save_80m's shard size for the shared-out save: several files, so each rank owns some.
SHARED_SHARD = "40MB"


def zero3_child(variant: str) -> dict[str, float]:
    """One rank of the 2-rank ZeRO-3 save (under torchrun): its extra peak and the sizes."""
    import shutil
    import tempfile

    import torch

    from rlpipe.stages.common import deepspeed as ds
    from rlpipe.stages.common import handoff, partitioned_handoff
    from rlpipe.stages.common.background import wait_for_background
    from rlpipe.stages.common.distributed import init_distributed
    from rlpipe.stages.common.tiny import build_model, save_pretrained, train_tokenizer

    torch.set_num_threads(1)
    d = init_distributed()
    deepspeed = ds.import_deepspeed()
    tok = train_tokenizer(["1 + 2 = 3", "the quick brown fox"])
    engine = ds.make_engine(build_model(tok, size="80m"), ds.ds_config(3, micro_batch_size=1, grad_accum=1,
                            world_size=d.world_size, grad_clip=1.0),
                            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-5))
    sizes = [sum(p.ds_numel * p.element_size() for p in m.parameters(recurse=False)) for m in engine.module.modules()]
    shared_out = [tempfile.mkdtemp(prefix="bench_memory_") if d.rank == 0 else None]
    torch.distributed.broadcast_object_list(shared_out, src=0)  # (one folder: the ranks write into one staging)
    out = Path(shared_out[0])
    if variant == "shared":  # (the files' layout, learnt from a first save as the hand-over does: not measured)
        with ds.full_parameters(engine, rank=0) as whole:
            if d.rank == 0:
                handoff.hand_over(whole, tok, out / "first", max_shard_size=SHARED_SHARD, copy=False, stable=True,
                                  disposable=True, manifest_fields={"stage": "optimize"})
        partitioned_handoff.learn_plan(engine.module, tok, SHARED_SHARD, handoff.last_form() if d.rank == 0 else None)
        wait_for_background()
    torch.distributed.barrier()
    held = _rss_mb("VmRSS")
    _reset_peak()
    if variant == "before":
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
            if d.rank == 0:
                save_pretrained(engine.module, tok, out / "policy")
    elif variant == "shared":
        plan = partitioned_handoff.plan_for(engine.module, tok, SHARED_SHARD)
        partitioned_handoff.hand_over(engine.module, plan, out / "policy", manifest_fields={"stage": "optimize"})
        wait_for_background()
    else:
        ds.save_pretrained(engine, tok, out / "policy", d.rank, keep_copy=False)
    extra = _rss_mb("VmHWM") - held
    torch.distributed.barrier()
    shutil.rmtree(out, ignore_errors=True)
    return {"rank": d.rank, "extra_mb": extra, "largest_layer_mb": max(sizes) / 2**20,
            "model_mb": sum(sizes) / 2**20}


#: offload's variants: (offload_optimizer, offload_params)
OFFLOAD = {"off": (False, False), "optimizer": (True, False), "optimizer_and_params": (True, True)}


def offload_child(variant: str, size: str) -> dict[str, float]:
    """One rank's ZeRO-3 optimizer step with `variant`'s offload (under torchrun, one process)."""
    import time

    import torch

    from rlpipe.stages.common import deepspeed as ds
    from rlpipe.stages.common.distributed import init_distributed
    from rlpipe.stages.common.tiny import build_model, train_tokenizer

    cuda = torch.cuda.is_available()
    torch.set_num_threads(8 if cuda else 1)
    d = init_distributed()
    tok = train_tokenizer(["1 + 2 = 3", "the quick brown fox"])
    optimizer, params = OFFLOAD[variant]
    config = ds.ds_config(3, micro_batch_size=2, grad_accum=1, world_size=d.world_size, grad_clip=1.0, bf16=cuda,
                          offload_optimizer=optimizer, offload_params=params)
    engine = ds.make_engine(build_model(tok, size=size, max_positions=512), config,
                            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-5))
    ids = torch.randint(3, len(tok), (2, 512), generator=torch.Generator().manual_seed(0)).to(engine.device)

    def step() -> None:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    step()  # (the optimizer state is made at the first step)

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated() / 2**20
        return _rss_mb("VmRSS")

    held = now()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        _reset_peak()
    started = time.perf_counter()
    step()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else _rss_mb("VmHWM")
    return {"held_mb": round(held, 1), "peak_mb": round(max(peak, now()), 1), "step_s": round(seconds, 3),
            "parameters": sum(p.ds_numel for p in engine.module.parameters()),
            "device": torch.cuda.get_device_name(0) if cuda else "cpu"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=1024, help="response tokens per row (2 rows)")
    parser.add_argument("--chunk", type=int, default=256, help="logprob_chunk_tokens of the after case "
                        "(default: the knob's default)")
    from rlpipe.stages.common.tiny import SIZES

    parser.add_argument("--offload-size", default="1b", choices=list(SIZES), help="base_model.size of the offload case")
    parser.add_argument("--cases", nargs="+", default=[c for c in CASES if c != "offload"], choices=list(CASES))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("FIGURES " + json.dumps(child(args.child, args.tokens, args.chunk, args.offload_size)), flush=True)
        return 0
    figures = {case: CASES[case](args) for case in args.cases}
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def _run_child(case: str, args: argparse.Namespace, ranks: int = 0) -> list[dict[str, float]]:
    """The figures of `case` from a child process (0 ranks), or one per rank under torchrun."""
    from rlpipe.cluster.launch import free_port

    me = [__file__, "--child", case, "--tokens", str(args.tokens), "--chunk", str(args.chunk),
          "--offload-size", args.offload_size]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
            str(free_port()), *me] if ranks else [sys.executable, *me])
    # glibc raises its mmap threshold to the size of each large block freed, after which blocks that
    # size come from the heap and stay in the resident set once freed: 80m's 6.8 MB layers, gathered
    # and freed one after another, grew rank 1's RSS by 138 MB though at most 13.5 MB were live. A
    # fixed threshold (glibc's default, 128 KiB) returns every large block when freed: RSS is live memory.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"bench_memory: {case} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return [json.loads(line.split("FIGURES ", 1)[1]) for line in out.stdout.splitlines() if "FIGURES " in line]


def reference_batch(args: argparse.Namespace) -> dict[str, float]:
    got = {v: _run_child(f"reference_{v}", args)[0]["extra_mb"] for v in ("before", "after", "floor")}
    f = {"extra_before_mb": round(got["before"], 1), "extra_after_mb": round(got["after"], 1),
         "floor_mb": round(got["floor"], 1), "rows": 64, "batch_size": 32, "max_tokens_per_batch": REFERENCE_BUDGET}
    print(f"reference_batch (64 rows, 8 of 1,536 response tokens, 56 of 48; V = {REFERENCE_VOCAB}; packed): extra "
          f"before {f['extra_before_mb']:.0f} MB (32 rows a pass), after {f['extra_after_mb']:.0f} MB (and "
          f"<= {REFERENCE_BUDGET} tokens a pass: {f['extra_before_mb'] / max(f['extra_after_mb'], 1e-9):.1f}x lower), "
          f"floor {f['floor_mb']:.0f} MB (the longest row alone)")
    return f


def zero3_save_80m(args: argparse.Namespace) -> dict[str, float]:
    before = sorted(_run_child("zero3_before", args, ranks=2), key=lambda r: r["rank"])
    after = sorted(_run_child("zero3_after", args, ranks=2), key=lambda r: r["rank"])
    shared = sorted(_run_child("zero3_shared", args, ranks=2), key=lambda r: r["rank"])
    largest, model = after[0]["largest_layer_mb"], after[0]["model_mb"]
    f = {"extra_before_mb": [round(r["extra_mb"], 1) for r in before],
         "extra_after_mb": [round(r["extra_mb"], 1) for r in after],
         "extra_shared_mb": [round(r["extra_mb"], 1) for r in shared],
         "host_copy_mb": round(model, 1), "largest_layer_mb": round(largest, 1), "floor_mb": round(largest, 1),
         "ranks": 2}
    print(f"zero3_save_80m (2 ranks, fp32, {model:.0f} MB of parameters): extra per rank before "
          f"{f['extra_before_mb']} MB (every parameter gathered), after {f['extra_after_mb']} MB (gathered to rank 0 a parameter at a time; "
          f"rank 0 also builds the {model:.0f} MB host copy it writes), shared out {f['extra_shared_mb']} MB "
          f"(each rank its own {SHARED_SHARD} files); largest layer {largest:.1f} MB")
    return f


def logprob_entropy(args: argparse.Namespace) -> dict[str, float]:
    got = {}
    for case in ("before", "after", "floor"):
        got[case] = _run_child(case, args)[0]["extra_mb"]
    chunk_mb = (2 * args.chunk * VOCAB + VOCAB * HIDDEN) * 4 / 2**20
    f = {"extra_before_mb": round(got["before"], 1), "extra_after_mb": round(got["after"], 1),
         "floor_mb": round(got["floor"], 1), "chunk_mb": round(chunk_mb, 1), "rows": 2, "response_tokens": args.tokens,
         "vocab": VOCAB, "chunk_tokens": args.chunk}
    print(f"logprob_entropy (2 rows x {args.tokens} response tokens, V = {VOCAB}, fp32, chunk {args.chunk}):")
    print(f"  extra before {f['extra_before_mb']:.0f} MB, after {f['extra_after_mb']:.0f} MB "
          f"({f['extra_before_mb'] / max(f['extra_after_mb'], 1e-9):.1f}x lower), floor {f['floor_mb']:.0f} MB, "
          f"one chunk ~{chunk_mb:.0f} MB: after - floor = {f['extra_after_mb'] - f['floor_mb']:.0f} MB")
    return f


def offload(args: argparse.Namespace) -> dict[str, float]:
    print(f"offload (ZeRO-3, one rank, base_model.size={args.offload_size}; held before the step / peak during "
          "it / step seconds), each variant as it ends:", flush=True)
    f = {}
    for variant in OFFLOAD:
        f[variant] = r = _run_child(f"offload_{variant}", args, ranks=1)[0]
        print(f"  {variant:>20}: {r['held_mb']:,.0f} / {r['peak_mb']:,.0f} MB, {r['step_s']:.2f} s "
              f"({r['parameters'] / 1e9:.2f}B parameters, {r['device']})", flush=True)
    return {"size": args.offload_size, **f}


CASES = {"logprob_entropy": logprob_entropy, "reference_batch": reference_batch, "zero3_save_80m": zero3_save_80m,
         "offload": offload}


if __name__ == "__main__":
    raise SystemExit(main())
