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

On a GPU both run there: the pipeline's stages pick CUDA by themselves (in the preset's
`model.dtype`, bf16 by default there: optimize with fp32 masters, the rollout engine and the other
frozen roles in bf16; resident rollout and optimize take GPU 0 by turns), and the plain loop samples
with its own fp32 weights and trains under bf16 autocast over them (its AdamW's weights are the
masters). `gpu_busy` is then the share of each iteration GPU 0 ran a kernel
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

import torch  # noqa: E402
from gpu_busy import GpuBusy  # noqa: E402
from plain_loop import PlainGRPO  # noqa: E402

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
    artifacts the keep rule pruned since count by their record; weights never written,
    `optimize.policy_weights: with_train_state`, count nothing)."""
    from rlpipe.pipelines.layout import RunLayout
    from rlpipe.schemas.pruning import PRUNED_NAME

    total = critical = 0
    folder = RunLayout(run_dir).stage(k, "policy").parent
    written = sorted({f.parent for name in ("_manifest.json", PRUNED_NAME) for f in folder.rglob(name)})
    for artifact in written:
        manifest = _manifest(artifact)
        size = sum(f.bytes for f in manifest.files if f.name not in manifest.not_written)
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
