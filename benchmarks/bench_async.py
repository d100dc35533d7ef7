"""Asynchronous iterations against synchronous ones: rollout and optimize each on its own resident
worker, `async.staleness` 0 (rollout k waits for optimize k-1) against 1 (rollout k+1 runs while
optimize k trains).

    .venv/bin/python benchmarks/bench_async.py [--sizes demo 20m] [--iterations 8] [--repeats 2] [--json FILE]
                                               [key=value ...]

The demo job (16 prompts x 8 samples, GRPO, exact-match reward) from a random Llama of each size
built locally (`base_model.size`; no SFT, so responses run to `rollout.max_new_tokens`), with the
default `keep`; rollout on 1 worker and optimize on 1 rank, one torch thread each (the driver
too), so that the two can run side by side on two cores. `--max-new-tokens` (32 by default) sets
the rollout's share: a random model never stops early, so generation costs what the decode steps
cost. S = 0 and S = 1 runs alternate (`--repeats` times each, the order reversed every other
time). Printed per size: seconds per iteration of each (the steady stretch's time over its
iterations: from the end of iteration S+1, after the workers started, to the end of the one
before last, which evaluates; a mean, as iterations of an overlapped run end in uneven bunches),
their ratio, and the medians of the rollout and optimize seconds of the synchronous runs (the
overlap can at best hide the shorter one). With `--json FILE`:
`{"<size>": {"sync_s": ..., "async_s": ..., "speedup": ..., "rollout_s": ..., "optimize_s": ...}}`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLACED = ["launch.launcher=processes", "launch.rollout.workers=1", "launch.rollout.cpus_per_task=1",
          "launch.optimize.ranks_per_node=1", "launch.optimize.cpus_per_task=1"]


def child(size: str, staleness: int, run_dir: Path, iterations: int, max_new_tokens: int, overrides: list[str]) -> dict:
    """One run; per iteration the seconds between iteration ends and each stage's seconds."""
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.pipelines.runner import Pipeline

    # keep={}: the project's default keep (`Keep()`), not the demo preset's keep-everything
    preset = load_preset("demo", [f"base_model.size={size}", "sft=null", f"iterations={iterations}", "eval_every=0",
                                  "loggers=[]", f"rollout.max_new_tokens={max_new_tokens}",
                                  f"async.staleness={staleness}", "keep={}", *PLACED, *overrides])
    pipeline = Pipeline(preset, run_dir, log=lambda line: print(line, file=sys.stderr, flush=True))
    assert pipeline.overlaps == (staleness > 0)
    pipeline.run()
    return {"iterations": [r.seconds for r in pipeline.records]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["demo", "20m"])
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--json", type=Path)
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--child", nargs=3, metavar=("SIZE", "STALENESS", "RUN_DIR"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        size, staleness, run_dir = a.child
        print(json.dumps(child(size, int(staleness), Path(run_dir), a.iterations, a.max_new_tokens, a.overrides)))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    figures: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="rlpipe-bench-async-") as tmp:
        for size in a.sizes:
            runs: dict[int, list[dict]] = {0: [], 1: []}
            for repeat in range(a.repeats):
                for s in (0, 1) if repeat % 2 == 0 else (1, 0):
                    started, load = time.perf_counter(), os.getloadavg()[0]
                    done = subprocess.run([sys.executable, __file__, "--child", size, str(s),
                                           str(Path(tmp) / f"{size}-{s}-{repeat}" / "runs" / "demo"),
                                           "--iterations", str(a.iterations), "--max-new-tokens",
                                           str(a.max_new_tokens), *a.overrides],
                                          env=env, capture_output=True, text=True)
                    if done.returncode != 0:
                        print(done.stderr[-4000:], file=sys.stderr)
                        raise SystemExit(f"bench_async: {size} staleness {s} failed (exit {done.returncode})")
                    runs[s].append(json.loads(done.stdout.strip().splitlines()[-1]))
                    print(f"{size:>5} staleness {s} run {repeat + 1}/{a.repeats}: {time.perf_counter() - started:.0f} s "
                          f"(load average {load:.1f} at its start)", file=sys.stderr, flush=True)
            figures[size] = summarise(runs)
    print(f"demo job, {a.iterations} iterations per run, {a.repeats} run(s) each, max_new_tokens {a.max_new_tokens}, "
          f"1 torch thread per process, {os.cpu_count()} cores")
    print("| size | sync s/iteration | async (S=1) s/iteration | speedup | rollout s | optimize s |")
    print("|---|---|---|---|---|---|")
    for size, f in figures.items():
        print(f"| {size} | {f['sync_s']:.2f} | {f['async_s']:.2f} | {f['speedup']:.2f}x | {f['rollout_s']:.2f} | "
              f"{f['optimize_s']:.2f} |")
    if a.json:
        a.json.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
    return 0


def summarise(runs: dict[int, list[dict]]) -> dict[str, float]:
    def per_iteration(s: int) -> float:  # (intervals between iteration ends: they telescope)
        spans = [it["total"] for run in runs[s] for it in run["iterations"][s + 2:-1]]
        return sum(spans) / len(spans)

    def median(key: str) -> float:
        return statistics.median(it[key] for run in runs[0] for it in run["iterations"][2:-1])

    sync, asyn = per_iteration(0), per_iteration(1)
    return {"sync_s": sync, "async_s": asyn, "speedup": sync / asyn, "rollout_s": median("rollout"),
            "optimize_s": median("optimize")}


if __name__ == "__main__":
    sys.exit(main())
