"""LoRA vs full fine-tuning in the optimize stage, side by side on the same model and batch.

Each variant runs the real optimize stage (DeepSpeed, CPU) in a process of its own, so that the
peak resident memory (`resource.getrusage` max RSS) is that variant's alone; the stage runs
`--iterations` times in a chain (train state carried, as in a pipeline). Printed per variant:
trainable / total parameters, the bytes of the AdamW state and of the gradients (counted from the
engine's tensors), the peak RSS and its rise over the process before the stage (torch and
DeepSpeed imported, nothing loaded), and the median time of one optimize run.

    .venv/bin/python benchmarks/bench_lora.py [--hidden 512] [--layers 8] [--rows 64] [--r 8]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def build(root: Path, hidden: int, layers: int, rows: int) -> None:
    """Artifacts from bench_optimize's builder, and a policy of the asked size in place of its own."""
    from bench_optimize import build_inputs
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlpipe.stages.common.tiny import load_tokenizer, save_pretrained

    build_inputs(root, "demo", rows, group_size=8, resp_len=16)
    tok = load_tokenizer(root / "policy")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=int(2.75 * hidden),
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                         max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    save_pretrained(LlamaForCausalLM(config), tok, root / "policy")


def variant(root: Path, name: str, r: int, iterations: int, micro_batch_size: int) -> dict:
    """One variant in this process: the chained optimize runs; the figures as a dict."""
    import rlpipe.stages.common.deepspeed as ds
    from rlpipe.stages.optimize import run as optimize
    from rlpipe.stages.optimize.config import OptimizeConfig

    ds.import_deepspeed()
    before = _rss_mib()
    counted: dict[str, float] = {}
    times, state = [], None
    policy = root / "policy"
    for k in range(iterations):
        out = root / f"{name}{k}"
        cfg = OptimizeConfig(policy=policy, rollouts=root / "rollouts", advantages=root / "advantages",
                             output=out / "policy", metrics_output=out / "metrics", train_state=state,
                             train_state_output=out / "state", lr=1e-4, micro_batch_size=micro_batch_size,
                             lora={"r": r, "alpha": 2 * r} if name == "lora" else None)
        mark = time.perf_counter()
        optimize.run(cfg)
        times.append(time.perf_counter() - mark)
        if k == 0:
            from rlpipe.stages.optimize.replay import WARM

            engine = next(iter(WARM.by_state.values())).policy  # the policy engine, kept warm
            params = list(dict.fromkeys(engine.module.parameters()))
            counted["trainable"] = sum(p.numel() for p in params if p.requires_grad)
            counted["total"] = sum(p.numel() for p in params)
            counted["grad_mib"] = counted["trainable"] * 4 / 2**20  # one fp32 gradient per trained weight
            opt = engine.optimizer
            inner = getattr(opt, "optimizer", opt)
            counted["adam_mib"] = sum(t.numel() * t.element_size() for s in inner.state.values()
                                      for t in s.values() if torch.is_tensor(t) and t.dim() > 0) / 2**20
        policy, state = cfg.output, cfg.train_state_output
    state_mib = sum(f.stat().st_size for f in Path(state).rglob("*") if f.is_file()) / 2**20
    return {**counted, "peak_rss_mib": _rss_mib(), "rss_rise_mib": _rss_mib() - before,
            "run_s": statistics.median(times[1:] or times), "state_mib": state_mib}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--variant", choices=["full", "lora"], help=argparse.SUPPRESS)  # a child process
    ap.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(variant(args.root, args.variant, args.r, args.iterations, args.micro_batch_size)))
        return
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        root = Path(tmp)
        build(root, args.hidden, args.layers, args.rows)
        got = {}
        for name in ("full", "lora"):
            cmd = [sys.executable, __file__, "--variant", name, "--root", str(root), "--r", str(args.r),
                   "--iterations", str(args.iterations), "--micro-batch-size", str(args.micro_batch_size)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            got[name] = json.loads(out.strip().splitlines()[-1])
    print(f"Llama hidden {args.hidden}, {args.layers} layers; {args.rows} rows; LoRA r={args.r} all-linear; "
          f"{args.iterations} chained optimize runs per variant (CPU, ZeRO 0, fp32)")
    rows = [("trainable parameters", "trainable", "{:,.0f}"), ("total parameters", "total", "{:,.0f}"),
            ("AdamW state (MiB)", "adam_mib", "{:.1f}"), ("gradients (MiB)", "grad_mib", "{:.1f}"),
            ("train state on disk (MiB)", "state_mib", "{:.1f}"), ("peak RSS (MiB)", "peak_rss_mib", "{:.0f}"),
            ("RSS rise during the stage (MiB)", "rss_rise_mib", "{:.0f}"), ("optimize run, median (s)", "run_s", "{:.2f}")]
    print(f"{'':34}{'full':>14}{'lora':>14}")
    for label, key, fmt in rows:
        print(f"{label:34}{fmt.format(got['full'][key]):>14}{fmt.format(got['lora'][key]):>14}")


if __name__ == "__main__":
    main()
