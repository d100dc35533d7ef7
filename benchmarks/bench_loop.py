"""The pipeline's overhead over the same math: a plain-PyTorch single-process GRPO loop beside the
pipeline on the same job, in one process tree.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_loop.py [--iterations 10] [--warmup 2] [key=value ...]
    .venv/bin/python benchmarks/bench_loop.py --sizes 1m 80m --launchers local resident [--json FILE]

The pipeline is `Pipeline` with the preset's launcher (`local`: every stage in the driver's process;
`resident`: rollout and optimize on resident worker groups of local processes), writing every
artifact (rollouts, scores, advantages, policy checkpoint, train state on its cadence, metrics,
configs, report). The plain loop is what those stages compute, with nothing written: the same
prompts per iteration, KV-cache sampling of G samples per prompt with the same knobs and per-group
seeds (the transformers engine's decode loop, on the plain loop's own model), the preset's reward
components, the preset's advantage estimator (group-normalised for GRPO), a reference forward when
the preset has a reference model, and one persistent torch AdamW (same LR schedule, gradient
clipping) over the optimize stage's row schedule and loss. Both start from the pipeline's starting
policy; set-up (task, base model, SFT, first evaluation) is excluded.

They alternate: after pipeline iteration k (its stages, records and report) the plain loop runs its
iteration k in the driver's process, so machine load hits both alike. A pipeline iteration's time
is the wall time from the end of the previous plain iteration to the pipeline's per-iteration
callback, i.e. everything the runner does for that iteration. Its last iteration also runs the
final held-out evaluation, so it is run but left out; so are the first `--warmup` iterations (lazy
imports, first engine build). The reported figures are medians over the rest. Every process runs
`--threads` torch threads (1: the CPU figures).

On a GPU both run there: the pipeline's stages pick CUDA by themselves (optimize in bf16 with fp32
masters, the transformers rollout engine in fp32; resident rollout and optimize take GPU 0 by
turns), and the plain loop samples in fp32 and trains under bf16 autocast over fp32 weights (its
AdamW's weights are the masters). `gpu_busy` is then the share of each iteration GPU 0 ran a kernel
(`gpu_busy.py`, NVML), for each side.

The pipeline's seconds are split into `stages` (rollout, score, advantage, reference with their
artifacts' IO, plus optimize's forward/backward passes and old log-probs: the work the plain loop
does too), `optimize_other` (the optimize stage's other seconds on the critical path: engine
set-up, the policy's hand-off or save and its hashes, the metrics) and `driver` (records, report,
prune, configs, between the stages). Bytes: what an iteration writes (its artifacts and train state), and of those what is
written on the critical path (not by a background thread).

With `--sizes`, each size (`base_model.size`, no SFT: a random-init model of that size) and
launcher runs in a child process of its own, one after another; `--json FILE` then writes
`{"<size>": {"<launcher>": {"ratio": r, "pipeline_s": p, "plain_s": q, "critical_bytes": b, ...}}}`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gpu_busy import GpuBusy  # noqa: E402


class PlainGRPO:
    """One iteration = sample, reward, advantages, (reference), one persistent-AdamW update, all in
    memory; the knobs are the pipeline plan's stage configs of the same iteration."""

    def __init__(self, plan: Any):
        from rlpipe.schemas import PROMPTS, read_table_artifact
        from rlpipe.stages.common.deepspeed import use_bf16
        from rlpipe.stages.common.tiny import load_checkpoint
        from rlpipe.stages.optimize.core import lr_factor
        from rlpipe.stages.rollout.hf_engine import TransformersEngine

        self.plan = plan
        calls = {c.name: c.config for c in plan.iteration(0)}
        unsupported = [name for name in ("filter",) if name in calls]
        if calls["optimize"].critic is not None or unsupported or calls["rollout"].engine != "transformers":
            raise SystemExit("bench_loop: the plain loop implements GRPO-style presets (no critic, no filter, "
                             "the transformers engine)")
        o = calls["optimize"]
        start = plan.start_policy()
        self.model, self.tokenizer = load_checkpoint(start)  # its own trainable copy
        self.reference = load_checkpoint(start)[0] if calls.get("reference") is not None else None
        self.engine = TransformersEngine(start, calls["rollout"])
        self.engine.model = self.model  # the engine's decode loop over the plain loop's model
        # The rollout's device (a GPU where there is one), the pipeline's too; where optimize trains
        # in bf16 (DeepSpeed: bf16 weights, fp32 masters), the plain loop's forward and backward run
        # under bf16 autocast over fp32 weights: the same matrix products, AdamW on fp32 as its masters.
        self.device = self.engine.device
        self.model.to(self.device)
        if self.reference is not None:
            self.reference.to(self.device)
        self.bf16 = self.device.type == "cuda" and use_bf16(o.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=o.lr, weight_decay=o.weight_decay, betas=o.betas)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(
            s, o.lr_schedule, warmup_steps=o.warmup_steps, total_steps=o.total_steps, min_lr_ratio=o.min_lr_ratio))
        self.prompts = read_table_artifact(calls["rollout"].prompts, PROMPTS).to_pylist()
        self.rewards: list[float] = []
        self.phases: list[dict[str, float]] = []  # per iteration: seconds of sample, reward+advantages, optimize

    def iteration(self, k: int) -> None:
        from rlpipe.stages.common.forward import pack, response_logprobs, teacher_forced_logprobs
        from rlpipe.stages.rollout.core import group_seed, select_prompts
        from rlpipe.stages.rollout.engines import SamplingSpec

        calls = {c.name: c.config for c in self.plan.iteration(k)}
        r, o = calls["rollout"], calls["optimize"]
        # 1. Sample: the rollout stage's prompts, seeds, batches and knobs.
        groups = [self.prompts[i] for i in select_prompts(len(self.prompts), r.group_count(), r.prompt_offset)]
        prompt_ids = [list(self.tokenizer(g["prompt"]).input_ids) for g in groups]
        params = SamplingSpec(group_size=r.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, stop=tuple(r.stop), stop_token_ids=tuple(r.stop_token_ids))
        t0 = time.perf_counter()
        self.model.eval()
        samples = []
        for lo in range(0, len(groups), r.batch_size):
            ids = range(lo, min(lo + r.batch_size, len(groups)))
            samples += self.engine.generate([prompt_ids[g] for g in ids],
                                            [group_seed(r.seed, r.iteration, g) for g in ids], params)
        rows = [(g, i, s) for g, group in enumerate(samples) for i, s in enumerate(group)]  # (group_id, sample_index)
        prompts = [prompt_ids[g] for g, _, _ in rows]
        responses = [s.token_ids for _, _, s in rows]
        t1 = time.perf_counter()
        # 2. Reward: the score stage's components, R = sum_k w_k r_k.
        reward = self._reward(calls["score"], groups, rows)
        self.rewards.append(float(reward.mean()))
        # 3. Advantages: the preset's estimator on (R, group ids); A_t = A_i on every token.
        adv = self._advantages(calls["advantage"], reward, rows, responses)
        ref = (teacher_forced_logprobs(self.reference, prompts, responses, self.engine.pad_id)
               if self.reference is not None else None)
        t2 = time.perf_counter()
        # 4. Optimize: the stage's row schedule, loss and one persistent AdamW.
        self._optimize(o, prompts, responses, adv, ref, pack, response_logprobs)
        self.phases.append({"sample": t1 - t0, "reward+advantage": t2 - t1, "optimize": time.perf_counter() - t2})

    def _reward(self, score: Any, groups: list[dict], rows: list) -> np.ndarray:
        from rlpipe.stages.score.core import combine
        from rlpipe.stages.score.scorers import Rows, build_scorer, run_scorer

        view = Rows(shard=Path("plain"), prompts=[groups[g]["prompt"] for g, _, _ in rows],
                    responses=[s.text for _, _, s in rows], answers=[groups[g]["answer"] for g, _, _ in rows],
                    lengths=np.array([len(s.token_ids) for _, _, s in rows]), group_ids=[g for g, _, _ in rows],
                    sample_indices=[i for _, i, _ in rows], metadata=[{} for _ in rows])
        values = [run_scorer(c, build_scorer(c), view) for c in score.components]
        return combine([c.weight for c in score.components], values)

    def _advantages(self, advantage: Any, reward: np.ndarray, rows: list, responses: list) -> list[np.ndarray]:
        from rlpipe.stages.advantage.estimators import AdvantageInputs, compute_advantages
        from rlpipe.stages.advantage.kl import last_token_rewards
        from rlpipe.stages.common.tables import length_mask

        if advantage.kl.in_reward:
            raise SystemExit("bench_loop: KL in the reward is not in the plain loop")
        rewards = torch.tensor(reward, dtype=torch.float64)
        mask = length_mask(torch.tensor([len(x) for x in responses], dtype=torch.long))
        out = compute_advantages(advantage.estimator, AdvantageInputs(
            rewards, torch.tensor([g for g, _, _ in rows]), mask, last_token_rewards(rewards, mask)))
        return [out.token_advantages[b, : len(x)].float().numpy() for b, x in enumerate(responses)]

    def _optimize(self, o: Any, prompts: list, responses: list, adv: list, ref: list | None, pack: Any,
                  response_logprobs: Any) -> None:
        from rlpipe.stages.optimize.core import (
            PolicyObjective,
            epoch_order,
            policy_micro_loss,
            step_slices,
        )
        from rlpipe.stages.optimize.data import pad_rows

        obj = PolicyObjective(loss=o.loss, agg_mode=o.agg_mode, kl_estimator=o.kl_estimator, kl_beta=o.kl_beta,
                              entropy_coef=o.entropy_coef, kl_clamp=o.kl_clamp)
        n = len(responses)
        lengths = np.array([len(x) for x in responses])
        max_len = o.max_len or int(lengths.max())
        old: dict[int, np.ndarray] = {}
        self.model.train()
        for epoch in range(o.epochs):
            for micro_batches in step_slices(epoch_order(n, o.seed, epoch, o.shuffle), o.minibatch_size or n, 1, 0,
                                             o.micro_batch_size):
                picked = lengths[np.concatenate(micro_batches)]
                n_tok, n_seq = float(picked.sum()), float((picked > 0).sum())
                for rows in micro_batches:
                    packed = pack([prompts[i] for i in rows], [responses[i] for i in rows],
                                  self.engine.pad_id).to(self.device)
                    T = packed.mask.shape[1]
                    with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                        logits = self.model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits
                    logp = response_logprobs(logits, packed)
                    if int(rows[0]) not in old:  # before the first update: old = this forward, detached
                        old.update({int(i): logp[b, : len(responses[i])].detach().cpu().numpy().copy()
                                    for b, i in enumerate(rows)})
                    old_b, adv_b, ref_b = (None if x is None else pad_rows(x, rows, T).to(self.device)
                                           for x in (old, adv, ref))
                    loss, _ = policy_micro_loss(
                        obj, logp, old_b, adv_b, packed.mask, token_count=n_tok, seq_count=n_seq,
                        max_len=max_len, ref_logp=ref_b)
                    loss.backward()
                if o.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), o.grad_clip)
                self.opt.step()
                self.schedule.step()
                self.opt.zero_grad(set_to_none=True)


LAUNCHERS = ("local", "resident")


def launcher_overrides(launcher: str, threads: int) -> list[str]:
    """`local`: every stage in the driver; `resident`: rollout and optimize on one worker each, with
    the driver's torch threads, both on GPU 0 by turns where there is a GPU (as bench_scale.py)."""
    if launcher == "local":
        return ["launch.launcher=local"]
    gpus = 1 if torch.cuda.is_available() else 0
    return ["launch.launcher=processes", "launch.resident=true", "launch.rollout.workers=1",
            f"launch.rollout.cpus_per_task={threads}", "launch.optimize.ranks_per_node=1",
            f"launch.optimize.cpus_per_task={threads}",
            *([f"launch.rollout.gpus_per_worker={gpus}", f"launch.optimize.gpus_per_node={gpus}",
               "launch.share_gpus=[rollout,optimize]"] if gpus else [])]


def measure(preset_name: str, overrides: list[str], iterations: int, warmup: int,
            run_dir: Path | None) -> dict[str, Any]:
    """Run the pipeline and the plain loop side by side; the figures (see the module doc)."""
    from rlpipe.pipelines.cli import _quiet_libraries
    from rlpipe.pipelines.preset import load_preset

    _quiet_libraries()
    total = warmup + iterations + 1  # + the last one, which also runs the final evaluation
    preset = load_preset(preset_name, [f"iterations={total}", "eval_every=0", *overrides])
    if run_dir is None:  # a temporary run, removed after its figures (a 1B run writes gigabytes)
        scratch = Path(tempfile.mkdtemp(prefix="bench_loop_"))
        try:
            return _measure(preset, overrides, iterations, warmup, total, scratch / preset.name)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return _measure(preset, overrides, iterations, warmup, total, run_dir)


def _measure(preset: Any, overrides: list[str], iterations: int, warmup: int, total: int,
             run_dir: Path) -> dict[str, Any]:
    from rlpipe.pipelines.runner import Pipeline

    pipeline_s: dict[int, float] = {}
    plain_s: dict[int, float] = {}
    windows: dict[str, dict[int, tuple[float, float]]] = {"pipeline": {}, "plain": {}}  # perf_counter spans
    plain: list[PlainGRPO] = []
    mark = [0.0]

    def after_iteration(record: Any) -> None:
        now = time.perf_counter()
        if record.iteration > 0:  # iteration 0's start is inside the runner (after its set-up)
            pipeline_s[record.iteration] = now - mark[0]
            windows["pipeline"][record.iteration] = (mark[0], now)
        if not plain:
            plain.append(PlainGRPO(pipeline.plan))  # after set-up: the starting policy exists
        t0 = time.perf_counter()
        plain[0].iteration(record.iteration)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the plain loop's last kernels belong to its iteration
        mark[0] = time.perf_counter()
        plain_s[record.iteration] = mark[0] - t0
        windows["plain"][record.iteration] = (t0, mark[0])

    busy = GpuBusy() if torch.cuda.is_available() else None
    pipeline = Pipeline(preset, run_dir, log=lambda s: None, on_iteration=after_iteration)
    try:
        records = pipeline.run()
    finally:
        if busy is not None:
            busy.stop()

    measured = range(warmup, total - 1)
    pipe = statistics.median(pipeline_s[k] for k in measured)
    loop = statistics.median(plain_s[k] for k in measured)
    split = {name: statistics.median(v[k] for k in measured)
             for name, v in _split(records, pipeline_s, run_dir, measured).items()}
    by_stage = {name: statistics.median(r.seconds.get(name, 0.0) for r in records if r.iteration in measured)
                for name in records[measured.start].seconds if name != "total"}
    written = [_bytes_written(run_dir, k) for k in measured]
    figures = {"pipeline_s": pipe, "plain_s": loop, "ratio": pipe / loop, "split_s": split,
               "bytes": statistics.median(w[0] for w in written),
               "critical_bytes": statistics.median(w[1] for w in written), "stage_s": by_stage,
               "plain_split_s": {name: statistics.median(plain[0].phases[k][name] for k in measured)
                                 for name in plain[0].phases[0]},
               # the share of each iteration GPU 0 ran a kernel (NVML), median over the measured ones
               "gpu_busy": None if busy is None else {
                   side: statistics.median(busy.share(*spans[k]) for k in measured) for side, spans in windows.items()}}
    print(f"\npreset {preset.name}: {total} iterations, measured {measured.start}..{measured.stop - 1} "
          f"(warm-up {warmup}, last one has the final evaluation); torch threads {torch.get_num_threads()}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, {os.cpu_count()} CPUs")
    print(f"{'iter':>4} {'pipeline s':>11} {'plain s':>8} {'reward pipe':>12} {'reward plain':>13}")
    for r in records:
        print(f"{r.iteration:>4} {pipeline_s.get(r.iteration, float('nan')):>11.3f} {plain_s[r.iteration]:>8.3f} "
              f"{r.metrics.get('reward_mean', float('nan')):>12.3f} {plain[0].rewards[r.iteration]:>13.3f}")
    print(f"\npipeline ({' '.join(o for o in overrides if o.startswith('launch.launcher'))}): "
          f"median {pipe:.3f} s/iteration")
    print(f"plain PyTorch loop: median {loop:.3f} s/iteration")
    print(f"ratio pipeline / plain: {pipe / loop:.2f}x")
    print("pipeline split (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in split.items()))
    print("pipeline stages (median s, with their IO): " + ", ".join(f"{k} {v:.3f}" for k, v in by_stage.items()))
    print("plain loop split (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in figures["plain_split_s"].items()))
    print(f"bytes written per iteration: {figures['bytes'] / 1e6:.1f} MB, on the critical path "
          f"{figures['critical_bytes'] / 1e6:.1f} MB")
    if busy is not None:
        print(f"GPU 0 ({torch.cuda.get_device_name(0)}) busy: pipeline {figures['gpu_busy']['pipeline']:.0%} "
              f"of its iteration, plain loop {figures['gpu_busy']['plain']:.0%}")
    return figures


def _split(records: list, pipeline_s: dict[int, float], run_dir: Path, measured: range) -> dict[str, dict[int, float]]:
    """Per iteration: the stages' seconds but optimize's set-up and save, those, and the driver's."""
    from rlpipe.pipelines.layout import RunLayout

    layout = RunLayout(run_dir)
    out: dict[str, dict[int, float]] = {"stages": {}, "optimize_other": {}, "driver": {}}
    for r in records:
        if r.iteration not in measured:
            continue
        timing = _manifest(layout.stage(r.iteration, "policy")).extra.get("timing", {})
        optimize_compute = timing.get("loop_s", 0.0) + timing.get("old_logprobs_s", 0.0)
        stages = {k: v for k, v in r.seconds.items() if k != "total"}
        other = {k: v for k, v in stages.items() if k != "optimize"}
        out["stages"][r.iteration] = optimize_compute + sum(other.values())
        out["optimize_other"][r.iteration] = stages.get("optimize", 0.0) - optimize_compute
        out["driver"][r.iteration] = pipeline_s[r.iteration] - sum(stages.values())
    return out


def _manifest(path: Path) -> Any:
    """An artifact's manifest, or the one its record keeps where the run's keep rule pruned it."""
    from rlpipe.schemas import read_manifest
    from rlpipe.schemas.pruning import pruned

    record = pruned(path)
    return record.manifest if record is not None else read_manifest(path)


def _bytes_written(run_dir: Path, k: int) -> tuple[int, int]:
    """(bytes iteration k's artifacts held when written, of those written on the critical path;
    artifacts the keep rule pruned since count by their record)."""
    from rlpipe.pipelines.layout import RunLayout
    from rlpipe.schemas.pruning import PRUNED_NAME

    total = critical = 0
    folder = RunLayout(run_dir).stage(k, "policy").parent
    written = sorted({f.parent for name in ("_manifest.json", PRUNED_NAME) for f in folder.rglob(name)})
    for artifact in written:
        manifest = _manifest(artifact)
        size = sum(f.bytes for f in manifest.files)
        total += size
        if manifest.extra.get("written") != "background":
            critical += size
        elif manifest.extra.get("kind") == "causal":  # handed over: only its small files were written at once
            critical += sum(f.bytes for f in manifest.files if not f.name.endswith(".safetensors"))
    return total, critical


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--iterations", type=int, default=10, help="measured (steady-state) iterations")
    parser.add_argument("--warmup", type=int, default=2, help="iterations run first and left out")
    parser.add_argument("--run-dir", type=Path, default=None, help="keep the run here (default: a temporary directory, removed afterwards)")
    parser.add_argument("--sizes", nargs="+", default=None,
                        help="base_model sizes (no SFT), each in a child process; default: the preset as it is")
    parser.add_argument("--launchers", nargs="+", default=["local"], choices=LAUNCHERS)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of every process (1: the CPU figures; a GPU run's CPU side may want more)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the children and the resident workers too
    torch.set_num_threads(args.threads)
    if args.child:  # one size and launcher: the figures as one JSON line last
        figures = measure(args.preset, args.overrides, args.iterations, args.warmup, args.run_dir)
        print("FIGURES " + json.dumps(figures))
        return 0
    if args.sizes is None:
        results = {"preset": {launcher: measure(args.preset, [*launcher_overrides(launcher, args.threads),
                                                              *args.overrides], args.iterations, args.warmup,
                                                args.run_dir) for launcher in args.launchers}}
    else:
        results = {size: {launcher: _child(args, size, launcher) for launcher in args.launchers} for size in args.sizes}
    print(f"\n{'size':>6} {'launcher':>9} {'pipeline s/it':>14} {'plain s/it':>11} {'ratio':>6} {'stages':>8} "
          f"{'optimize other':>15} {'driver':>7} {'MB/it':>8} {'critical MB/it':>15}")
    for size, per in results.items():
        for launcher, f in per.items():
            s = f["split_s"]
            print(f"{size:>6} {launcher:>9} {f['pipeline_s']:>14.3f} {f['plain_s']:>11.3f} {f['ratio']:>5.2f}x "
                  f"{s['stages']:>8.3f} {s['optimize_other']:>15.3f} {s['driver']:>7.3f} {f['bytes'] / 1e6:>8.1f} "
                  f"{f['critical_bytes'] / 1e6:>15.1f}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"figures written to {args.json}")
    return 0


def _child(args: argparse.Namespace, size: str, launcher: str) -> dict[str, Any]:
    """One size and launcher in a child process (no warm state or memory carried between them)."""
    overrides = [f"base_model.size={size}", "sft=null", *launcher_overrides(launcher, args.threads), *args.overrides]
    cmd = [sys.executable, __file__, "--child", "--preset", args.preset, "--iterations", str(args.iterations),
           "--warmup", str(args.warmup), "--threads", str(args.threads), *overrides]
    print(f"\n== {size} {launcher}: {' '.join(overrides)}", flush=True)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    print(done.stdout.rsplit("FIGURES ", 1)[0], end="")
    if done.returncode != 0 or "FIGURES " not in done.stdout:
        raise SystemExit(f"bench_loop: {size} {launcher} failed (exit {done.returncode})")
    return json.loads(done.stdout.rsplit("FIGURES ", 1)[1])


if __name__ == "__main__":
    sys.exit(main())
