"""Reward-model scoring throughput on CPU (sequences/s) at several batch sizes.

    .venv/bin/python benchmarks/bench_score.py [--size demo] [--n 512] [--batch-sizes 1 8 32 128] [--repeats 3]

Builds a reward model of the named tiny size (random weights: the speed does not depend on them)
and N (prompt, response) texts of varied length (responses of 2..60 words), then, alternating
within each repeat so machine load hits both alike, for every batch size:
  ours   `score_texts`: the score stage's reward_model path (tokenise, sort by length, right-pad,
         backbone + head at the last real token)
  plain  the same model through transformers' own sequence-classification forward on batches in
         input order (tokenizer right padding; HF pools the rightmost non-pad token)
Best-of-N wall seconds -> sequences/s. Finally the whole stage (`run` on a rollouts artifact with
one reward_model component; reads, scores, writes and hashes shards) at one batch size.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

WORDS = "the of and a to in is that for it as was with be by on not he this are 1 2 3 4 5 + = answer".split()


def texts(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    rng = np.random.default_rng(seed)
    prompts = [f"Q: {a}+{b}= A:" for a, b in rng.integers(0, 20, size=(n, 2))]
    responses = [" " + " ".join(rng.choice(WORDS, size=int(k))) for k in rng.integers(2, 61, size=n)]
    return prompts, responses


@torch.no_grad()
def plain(model, tok, prompts, responses, batch_size: int) -> torch.Tensor:
    out = []
    tok.padding_side = "right"
    for i in range(0, len(prompts), batch_size):
        enc = tok([p + r for p, r in zip(prompts[i : i + batch_size], responses[i : i + batch_size], strict=True)],
                  padding=True, return_tensors="pt")
        out.append(model(**enc).logits[:, 0])
    return torch.cat(out)


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="demo", help="tiny model size (micro | tiny | demo)")
    ap.add_argument("--n", type=int, default=512, help="sequences scored per measurement")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from rlpipe.schemas import ROLLOUTS, write_table_artifact
    from rlpipe.stages.common.models import load_model
    from rlpipe.stages.common.tiny import build_model, save_pretrained, train_tokenizer
    from rlpipe.stages.reward_model.modeling import encode, score_texts
    from rlpipe.stages.score.config import ScoreConfig
    from rlpipe.stages.score.run import run

    prompts, responses = texts(args.n)
    root = Path(tempfile.mkdtemp(prefix="bench_score-"))
    tok = train_tokenizer([p + r for p, r in zip(prompts, responses, strict=True)])
    rm_dir = save_pretrained(build_model(tok, "reward", size=args.size, seed=0), tok, root / "rm")
    model, tok = load_model(rm_dir, "reward")
    lengths = [len(s) for s in encode(tok, prompts, responses, 1024)]
    params = sum(p.numel() for p in model.parameters())
    print(f"reward model '{args.size}' ({params / 1e6:.2f}M params), {args.n} sequences of "
          f"{min(lengths)}..{max(lengths)} tokens (mean {np.mean(lengths):.0f}), "
          f"torch threads {torch.get_num_threads()}, best of {args.repeats}")
    ref = score_texts(model, tok, prompts, responses, max_length=1024, batch_size=8)
    torch.testing.assert_close(plain(model, tok, prompts, responses, 8), ref, atol=1e-4, rtol=1e-4)

    print(f"{'batch':>6} {'ours seq/s':>11} {'plain seq/s':>12} {'ours/plain':>11}")
    for bs in args.batch_sizes:
        t_ours, t_plain = [], []
        for _ in range(args.repeats):  # alternate: load hits both alike
            t_ours.append(best(lambda bs=bs: score_texts(model, tok, prompts, responses, max_length=1024,
                                                         batch_size=bs), 1))
            t_plain.append(best(lambda bs=bs: plain(model, tok, prompts, responses, bs), 1))
        o, p = args.n / min(t_ours), args.n / min(t_plain)
        print(f"{bs:>6} {o:>11.0f} {p:>12.0f} {o / p:>10.2f}x")

    # The whole stage on an artifact: read, score, write, hash.
    n = args.n
    table = {
        "run": ["bench"] * n, "iteration": [0] * n, "policy_version": [0] * n,
        "prompt_id": [f"p{i // 8}" for i in range(n)], "group_id": [i // 8 for i in range(n)],
        "sample_index": [i % 8 for i in range(n)], "prompt": prompts, "prompt_token_ids": [[1, 2]] * n,
        "answer": [None] * n, "response": responses, "response_token_ids": [[3] * 4] * n,
        "response_logprobs": [[-1.0] * 4] * n, "finish_reason": ["stop"] * n,
        "sampling": [{"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 64}] * n,
        "engine": ["transformers"] * n, "seed": [0] * n, "metadata": [None] * n,
    }
    write_table_artifact(root / "rollouts", ROLLOUTS, table, stage="bench", shard_by="group_id", rows_per_shard=128)
    cfg = ScoreConfig(rollouts=root / "rollouts", output=root / "scores",
                      components=[{"name": "rm", "type": "reward_model", "checkpoint": rm_dir, "batch_size": 32}])
    t = best(lambda: run(cfg, force=True), args.repeats)
    print(f"stage (batch 32, {n} rows in {-(-n // 128)} shards, IO included): {n / t:.0f} seq/s")


if __name__ == "__main__":
    main()
