"""Throughput of the optimize stage's loop vs a plain PyTorch loop computing the same loss.

Both optimise the same tiny Llama on the same synthetic batch with the same row schedule
(seeded shuffle, minibatches, micro-batches), the same ppo_clip token-mean loss, AdamW and
gradient clipping. The stage runs through DeepSpeed (ZeRO stage of your choice) and also
computes its per-step metrics (entropy, KL, clip fraction, all-reduced); the plain loop only the
loss. Stage and plain runs alternate, so machine load hits both alike; the ratio is what to read.

    .venv/bin/python benchmarks/bench_optimize.py [--size demo] [--rows 64] [--zero 0] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def build_inputs(root: Path, size: str, rows: int, group_size: int, resp_len: int, seed: int = 0):
    """A tiny policy checkpoint plus rollouts and advantages artifacts (random responses, A = +-1)."""
    from rlpipe.schemas import ADVANTAGES, ROLLOUTS, write_table_artifact
    from rlpipe.stages.common.tiny import build_model, save_pretrained, train_tokenizer

    tok = train_tokenizer([f"Q: {a}+{b}= A: {a + b}" for a in range(20) for b in range(20)])
    save_pretrained(build_model(tok, "causal", size=size, seed=seed), tok, root / "policy")
    rng = np.random.default_rng(seed)
    vocab = [i for i in range(len(tok)) if i not in tok.all_special_ids]
    ro: dict[str, list] = {c: [] for c in ROLLOUTS.column_names}
    adv: dict[str, list] = {c: [] for c in ADVANTAGES.column_names}
    for i in range(rows):
        g, s = divmod(i, group_size)
        prompt = f"Q: {g % 20}+{(g * 7) % 20}= A:"
        n = int(rng.integers(resp_len // 2, resp_len + 1))
        resp = [int(x) for x in rng.choice(vocab, size=n)]
        a = float(rng.normal())
        for k, v in dict(run="bench", iteration=0, policy_version=0, prompt_id=f"p{g}", group_id=g, sample_index=s,
                         prompt=prompt, prompt_token_ids=tok(prompt)["input_ids"], answer=None, response="",
                         response_token_ids=resp, response_logprobs=[-1.0] * n, finish_reason="stop",
                         sampling=dict(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=resp_len),
                         engine="transformers", seed=seed, metadata=None).items():
            ro[k].append(v)
        for k, v in dict(run="bench", iteration=0, prompt_id=f"p{g}", group_id=g, sample_index=s, reward=a,
                         advantage=a, token_advantages=[a] * n, returns=None, values=None, ref_logprobs=None,
                         kl=None, estimator="synthetic", estimator_params="{}").items():
            adv[k].append(v)
    write_table_artifact(root / "rollouts", ROLLOUTS, ro, stage="bench", shard_by="group_id")
    write_table_artifact(root / "advantages", ADVANTAGES, adv, stage="bench")
    return root / "policy", root / "rollouts", root / "advantages"


def plain_loop(cfg, batch) -> tuple[float, float]:
    """(seconds, tokens) of a plain PyTorch loop over the stage's schedule and loss."""
    from rlpipe.stages.common.forward import pack, response_logprobs, teacher_forced_logprobs
    from rlpipe.stages.common.tiny import load_checkpoint
    from rlpipe.stages.optimize.core import epoch_order, step_slices
    from rlpipe.stages.optimize.data import pad_rows
    from rlpipe.stages.optimize.losses import agg_loss, ppo_clip

    model, tok = load_checkpoint(cfg.policy)
    pad = tok.pad_token_id
    old = teacher_forced_logprobs(model, batch.prompt_ids, batch.response_ids, pad)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas)
    n = len(batch)
    tokens = 0.0
    start = time.perf_counter()
    for epoch in range(cfg.epochs):
        for micro_batches in step_slices(epoch_order(n, cfg.seed, epoch), cfg.minibatch_size or n, 1, 0,
                                         cfg.micro_batch_size):
            n_tok = float(batch.lengths(np.concatenate(micro_batches)).sum())
            for rows in micro_batches:
                packed = pack([batch.prompt_ids[i] for i in rows], [batch.response_ids[i] for i in rows], pad)
                T = packed.mask.shape[1]
                logp = response_logprobs(model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits, packed)
                out = ppo_clip(logp, pad_rows(old, rows, T), pad_rows(batch.advantages, rows, T), packed.mask,
                               **cfg.loss.knobs())
                agg_loss(out.loss_mat, packed.mask, "token-mean", global_token_count=n_tok).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            tokens += n_tok
    return time.perf_counter() - start, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="demo", help="tiny model size (micro | tiny | demo)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--resp-len", type=int, default=32)
    p.add_argument("--minibatch", type=int, default=32)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (same for both loops)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from rlpipe.schemas import read_manifest
    from rlpipe.stages.optimize.config import OptimizeConfig
    from rlpipe.stages.optimize.data import load_batch
    from rlpipe.stages.optimize.run import run

    root = Path(tempfile.mkdtemp(prefix="bench-optimize-"))
    policy, rollouts, advantages = build_inputs(root, args.size, args.rows, 8, args.resp_len)
    cfg = OptimizeConfig(policy=policy, rollouts=rollouts, advantages=advantages, output=root / "out",
                         metrics_output=root / "metrics", lr=1e-4, epochs=args.epochs, minibatch_size=args.minibatch,
                         micro_batch_size=args.micro, zero_stage=args.zero)
    batch = load_batch(rollouts, advantages)
    run(cfg, force=True)  # warm-up: imports, DeepSpeed op loading
    plain_loop(cfg, batch)
    stage_tps, plain_tps, totals = [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        run(cfg, force=True)
        totals.append(time.perf_counter() - t0)
        stage_tps.append(read_manifest(cfg.output).extra["timing"]["tokens_per_s"])
        seconds, tokens = plain_loop(cfg, batch)
        plain_tps.append(tokens / seconds)
    s, q = statistics.median(stage_tps), statistics.median(plain_tps)
    print(f"model {args.size}, {args.rows} rows, {int(batch.lengths().sum())} response tokens, "
          f"{args.epochs} epochs, minibatch {args.minibatch}, micro-batch {args.micro}, ZeRO {args.zero}, "
          f"{args.threads} thread(s), median of {args.repeats}")
    print(f"{'loop':<28}{'tokens/s':>12}")
    print(f"{'stage (DeepSpeed) loop':<28}{s:>12.0f}")
    print(f"{'plain PyTorch loop':<28}{q:>12.0f}")
    print(f"{'ratio stage / plain':<28}{s / q:>12.2f}")
    print(f"stage run() wall time incl. setup, old log-probs, save: median {statistics.median(totals):.2f} s")
    print(json.dumps({"stage_tokens_per_s": stage_tps, "plain_tokens_per_s": plain_tps, "run_s": totals}))


if __name__ == "__main__":
    main()
