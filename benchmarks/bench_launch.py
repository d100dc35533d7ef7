"""Per-stage launch overhead: the same stage call in the driver's process (local) and launched
(processes: 2 worker processes / 2 torchrun ranks; slurm: srun steps, inside an allocation).

    python benchmarks/bench_launch.py [--repeat 3]
    salloc -n 2 python benchmarks/bench_launch.py --launchers local,slurm     # Slurm steps

A tiny 1-iteration run is made in-process first. Then each placed stage of its iteration is
called through each launcher twice over: `cached` (its manifest matches, so the launched
processes start, check the cache key and exit: the pure overhead of launching) and `forced`
(recomputed: overhead plus the work, with models loaded cold in every process).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

PRESET = {
    "name": "bench", "seed": 0, "iterations": 1, "prompts_per_iteration": 4, "eval_every": 0,
    "data": {"task": {"kind": "arithmetic", "a_range": [0, 9], "b_range": [0, 9], "ops": ["+"],
                      "n_train": 40, "n_heldout": 10}},
    "base_model": {"size": "micro"},
    "model": {"reference": True},
    "rollout": {"group_size": 4, "max_new_tokens": 3, "groups_per_shard": 2},
    "score": {"components": [{"name": "alnum", "type": "regex_format", "pattern": "[0-9A-Za-z]"}]},
    "optimize": {"lr": 1.0e-3, "micro_batch_size": 8},
    "evaluate": {"max_new_tokens": 3},
}
PLACEMENT = {"rollout": {"workers": 2}, "reference": {"workers": 2}, "optimize": {"nodes": 1, "ranks_per_node": 2}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launchers", default="local,processes", help="comma-separated: local, processes, slurm")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import yaml

    torch.set_num_threads(1)
    from rlpipe.cluster.launchers import launcher_for
    from rlpipe.cluster.placement import Launch
    from rlpipe.pipelines.cli import _quiet_libraries
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.pipelines.runner import Pipeline

    _quiet_libraries()
    launchers = args.launchers.split(",")
    if "slurm" in launchers and "SLURM_JOB_ID" not in os.environ:
        print("slurm: not inside an allocation, left out (run under `salloc -n 2`)", file=sys.stderr)
        launchers.remove("slurm")
    root = Path(tempfile.mkdtemp(prefix="bench_launch_"))
    (root / "bench.yaml").write_text(yaml.safe_dump(PRESET))
    pipeline = Pipeline(load_preset(root / "bench.yaml"), root / "runs" / "bench", log=lambda s: None)
    pipeline.run()
    calls = [c for c in pipeline.plan.iteration(0) if c.name in PLACEMENT]
    rows = []
    for name in launchers:
        launcher = launcher_for(Launch.model_validate({"launcher": name, **PLACEMENT}))
        for call in calls:
            for mode in ("cached", "forced"):
                times = []
                for _ in range(args.repeat):
                    started = time.perf_counter()
                    launcher(call, force=mode == "forced")
                    times.append(time.perf_counter() - started)
                rows.append((name, call.name, mode, statistics.median(times), min(times)))
    print(f"\nper-stage launch time, median (min) of {args.repeat}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'launcher':<10} {'stage':<10} {'placement':<22} {'cached s':>14} {'forced s':>14}")
    for name in launchers:
        for call in calls:
            cached, forced = (r for r in rows if r[0] == name and r[1] == call.name)
            where = "in-process" if name == "local" else ", ".join(f"{k}={v}" for k, v in PLACEMENT[call.name].items())
            print(f"{name:<10} {call.name:<10} {where:<22} {cached[3]:>7.2f} ({cached[4]:.2f}) {forced[3]:>7.2f} ({forced[4]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
