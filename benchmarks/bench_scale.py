"""What an RL iteration costs as the model grows, per launcher: every stage in the driver's process
(`local`), placed stages launched anew for every call (`per_call`: launcher processes,
`launch.resident=false`), and placed stages as resident worker groups (`resident`).

    .venv/bin/python benchmarks/bench_scale.py [--sizes 1m 20m 80m] [--iterations 5] [--repeats 2]
                                               [--threads 2] [--gpus 0] [--json FILE] [key=value ...]

For each size the demo job (16 prompts x 8 samples x up to 6 new tokens, GRPO, exact-match
reward, train state on the default cadence: every 10 iterations and the last where the engines
stay alive, every one when launched per call) starts from a random Llama of that size built locally
(`base_model.size`: ~1.2M, ~19M, ~83M, ~0.38B, ~0.97B parameters; no SFT), with the default `keep` (the last 2
train states, every 10th policy, the last and the best; the demo preset itself keeps everything)
and any `key=value` preset overrides given (`optimize.background_state_save=false`, ...). Placed:
rollout on 1 worker, optimize on 1 rank (with `--gpus 1` both on GPU 0: the transformers rollout
engine in fp32, optimize in bf16 with fp32 masters); score and advantage in the driver. Every
process gets `--threads` torch threads (the driver too), so the launchers compute alike: only
where the work runs differs. Each size and
launcher runs in its own driver process (no warm state carried between them), one after another.

Per size and launcher it prints: s/iteration (the median over iterations 1..N-2: the first pays
the start of every engine and worker, the last the final evaluation), the first iteration, the
split of a steady iteration, and the bytes written per iteration (the iteration's folder):
  compute      rollout generation, optimize's forward/backward passes (old log-probs included),
               and the stages in the driver (score, advantage)
  start/load   launch to the stage's own start (process start, imports, input checks) plus
               loading models, engines and the train state (rollout engine start, optimize setup)
  save         optimize writing its metrics and policy checkpoint (and the train state when it is
               not written in the background, `optimize.background_state_save`)
  other        the rest: writing rollouts and scores, manifests, the driver's records and report
It also prints the seconds of the optimize call (what the iteration waits for: the train-state
save included when it is not in the background), the train-state save's own seconds (in the
background by default: overlapping the next iteration), and the run's disk footprint after its
N iterations.
With `--json FILE` it writes `{"<size>": {"<launcher>": {"s_per_iteration": ..., "bytes_per_iteration":
..., "first_iteration_s": ..., "footprint_bytes": ..., "optimize_s": ..., "state_save_s": ..., "split": {...}}}}`.
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

LAUNCHERS = {
    "local": ["launch.launcher=local"],
    "per_call": ["launch.launcher=processes", "launch.resident=false"],
    "resident": ["launch.launcher=processes", "launch.resident=true"],
}


def child(size: str, launcher: str, run_dir: Path, iterations: int, threads: int, gpus: int,
          overrides: list[str]) -> dict:
    """One driver: the demo job at `size` under `launcher`; per iteration its driver-side stage
    times and the manifests' timings."""
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.pipelines.runner import Pipeline

    placement = [] if launcher == "local" else [
        "launch.rollout.workers=1", f"launch.rollout.cpus_per_task={threads}",
        f"launch.rollout.gpus_per_worker={gpus}",
        "launch.optimize.ranks_per_node=1", f"launch.optimize.cpus_per_task={threads}",
        f"launch.optimize.gpus_per_node={gpus}",
        # one GPU: the two resident groups take it by turns (refused otherwise, rlpipe.cluster.gpus)
        *(["launch.share_gpus=[rollout,optimize]"] if gpus else [])]
    # keep={}: the project's default keep (`Keep()`), not the demo preset's keep-everything
    preset = load_preset("demo", [f"base_model.size={size}", "sft=null", f"iterations={iterations}",
                                  "eval_every=0", "loggers=[]", "keep={}", *LAUNCHERS[launcher], *placement,
                                  *overrides])
    pipeline = Pipeline(preset, run_dir, log=lambda line: print(line, file=sys.stderr, flush=True))
    pipeline.run()
    from rlpipe.schemas.pruning import pruned
    from rlpipe.schemas.reading import recorded_manifest

    out = []
    for record in pipeline.records:
        folder = run_dir / f"iter_{record.iteration:04d}"
        # (pruned ones by their records: what they were, and how many bytes were written)
        # (the train state only every optimize.state_every iterations and the last)
        names = [n for n in ("policy", "train_state", "rollouts", "scores", "advantages", "metrics")
                 if n != "train_state" or (folder / n).exists() or pruned(folder / n) is not None]
        rollout, policy = (recorded_manifest(folder / name) for name in ("rollouts", "policy"))
        state = recorded_manifest(folder / "train_state") if "train_state" in names else None
        written = sum(f.bytes for name in names for f in recorded_manifest(folder / name).files)
        out.append({"seconds": record.seconds, "rollout": {"wall": rollout.wall_time_s, **rollout.extra["timing"]},
                    "optimize": {"wall": policy.wall_time_s, **policy.extra["timing"]},
                    "state_save_s": state.extra.get("save_s") if state is not None else None,
                    "bytes": written})
    footprint = sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file())
    return {"iterations": out, "footprint_bytes": footprint}


def split(it: dict) -> dict[str, float]:
    """compute / start_load / save / other of one iteration (see the module doc)."""
    s, r, o = it["seconds"], it["rollout"], it["optimize"]
    driver_stages = sum(v for k, v in s.items() if k not in ("rollout", "optimize", "total"))
    compute = r["generate_s"] + o["old_logprobs_s"] + o["loop_s"] + driver_stages
    start_load = (s["rollout"] - r["wall"]) + r["engine_start_s"] + (s["optimize"] - o["wall"]) + o["setup_s"]
    save = o["wall"] - o["setup_s"] - o["old_logprobs_s"] - o["loop_s"]
    return {"compute": compute, "start_load": start_load, "save": save,
            "other": s["total"] - compute - start_load - save}


def summarise(runs: list[dict]) -> dict:
    """Medians over the steady iterations of every run (see the module doc)."""
    steady = [it for run in runs for it in (run["iterations"][1:-1] or run["iterations"][-1:])]
    med = lambda key: statistics.median(key(it) for it in steady)  # noqa: E731
    return {"s_per_iteration": med(lambda it: it["seconds"]["total"]),
            "first_iteration_s": statistics.median(run["iterations"][0]["seconds"]["total"] for run in runs),
            "bytes_per_iteration": med(lambda it: it["bytes"]),
            "split": {k: med(lambda it, k=k: split(it)[k]) for k in ("compute", "start_load", "save", "other")},
            "optimize_s": med(lambda it: it["seconds"]["optimize"]),
            "state_save_s": med(lambda it: it["state_save_s"] or 0.0),
            "footprint_bytes": statistics.median(run["footprint_bytes"] for run in runs),
            "rollout_model_load": sorted({it["rollout"].get("model_load") for run in runs
                                          for it in run["iterations"][1:]}),
            "steady_iterations": len(steady)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["1m", "20m", "80m"])
    p.add_argument("--launchers", nargs="+", default=list(LAUNCHERS), choices=list(LAUNCHERS))
    p.add_argument("--iterations", type=int, default=5, help="iterations per run (>= 3: first and last are left out)")
    p.add_argument("--repeats", type=int, default=2, help="runs per size and launcher, in alternating order")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of every process")
    p.add_argument("--gpus", type=int, default=0, choices=(0, 1),
                   help="1: the placed rollout worker and optimize rank both get GPU 0 (a local run uses "
                        "it when CUDA is there); 0: placed stages run on CPU")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="preset overrides for every run")
    p.add_argument("--child", nargs=3, metavar=("SIZE", "LAUNCHER", "RUN_DIR"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        size, launcher, run_dir = a.child
        print(json.dumps(child(size, launcher, Path(run_dir), a.iterations, a.threads, a.gpus, a.overrides)))
        return 0

    figures: dict[str, dict[str, dict]] = {}
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    with tempfile.TemporaryDirectory(prefix="rlpipe-bench-scale-") as tmp:
        for size in a.sizes:
            runs: dict[str, list[dict]] = {launcher: [] for launcher in a.launchers}
            for repeat in range(a.repeats):
                for launcher in a.launchers if repeat % 2 == 0 else a.launchers[::-1]:
                    run_dir = Path(tmp) / f"{size}-{launcher}-{repeat}" / "runs" / "demo"
                    started, load = time.perf_counter(), os.getloadavg()[0]
                    done = subprocess.run([sys.executable, __file__, "--child", size, launcher, str(run_dir),
                                           "--iterations", str(a.iterations), "--threads", str(a.threads),
                                           "--gpus", str(a.gpus), *a.overrides],
                                          env=env, capture_output=True, text=True)
                    shutil.rmtree(run_dir.parent.parent)  # (at 1b each train state is ~12 GB)
                    if done.returncode != 0:
                        print(done.stderr[-4000:], file=sys.stderr)
                        raise SystemExit(f"bench_scale: {size} {launcher} failed (exit {done.returncode})")
                    runs[launcher].append(json.loads(done.stdout.strip().splitlines()[-1]))
                    steady = summarise(runs[launcher][-1:])
                    print(f"{size:>4} {launcher:<9} run {repeat + 1}/{a.repeats} done in "
                          f"{time.perf_counter() - started:.0f} s (load average {load:.1f} at its start): "
                          f"{steady['s_per_iteration']:.2f} s/iteration, first {steady['first_iteration_s']:.1f} s",
                          file=sys.stderr, flush=True)
            figures[size] = {launcher: summarise(r) for launcher, r in runs.items()}
            print(table({size: figures[size]}, a), file=sys.stderr, flush=True)  # (a long run may be cut short)
    print(table(figures, a))
    if a.json:
        a.json.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
    return 0


def table(figures: dict, a: argparse.Namespace) -> str:
    where = f"placed stages on GPU 0 ({_gpu_name()})" if a.gpus else f"{os.cpu_count()} cores"
    lines = [f"demo job, {a.repeats} run(s) of {a.iterations} iterations per size and launcher, {a.threads} torch "
             f"thread(s) per process, {where}; medians of iterations 1..{a.iterations - 2} of every run"
             + (f"; {' '.join(a.overrides)}" if a.overrides else ""),
             "| size | launcher | s/iteration | vs local | first iteration s | compute | start/load | save | "
             "other | optimize s | state save s | MB written/iteration | MB on disk after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for size, by in figures.items():
        base = by.get("local", {}).get("s_per_iteration")
        for launcher, f in by.items():
            sp = f["split"]
            ratio = f"{f['s_per_iteration'] / base:.2f}x" if base else "-"
            lines.append(f"| {size} | {launcher} | {f['s_per_iteration']:.2f} | {ratio} | {f['first_iteration_s']:.1f} | "
                         f"{sp['compute']:.2f} | {sp['start_load']:.2f} | {sp['save']:.2f} | {sp['other']:.2f} | "
                         f"{f['optimize_s']:.2f} | {f['state_save_s']:.2f} | {f['bytes_per_iteration'] / 1e6:.1f} | "
                         f"{f['footprint_bytes'] / 1e6:.0f} |")
    return "\n".join(lines)


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"


if __name__ == "__main__":
    sys.exit(main())
