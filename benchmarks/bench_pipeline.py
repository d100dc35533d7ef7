"""Where an iteration's time goes: per-stage wall time, the stages' own compute, and the rest
(orchestration, Parquet IO, checkpoint save/load, model cache look-ups).

    python benchmarks/bench_pipeline.py                 # demo preset, local in-process runner
    python benchmarks/bench_pipeline.py --prefect       # the same under the Prefect flow
    python benchmarks/bench_pipeline.py --iterations 10 --preset demo key=value ...

"Compute" is what the stages report themselves in their manifests: the rollout engine's generate
time, the optimiser's old-log-prob pass and training loop. Everything else inside an iteration
counts as outside compute. The set-up (data, base model, SFT, first evaluation) is excluded and
the first iteration is shown but left out of the steady-state mean (it pays the lazy imports and
DeepSpeed's first engine build).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path


def _compute_seconds(it: Path) -> dict[str, float]:
    def extra(name: str) -> dict:
        m = it / name / "_manifest.json"
        return json.loads(m.read_text())["extra"] if m.is_file() else {}

    t_roll = extra("rollouts").get("timing", {})
    t_opt = extra("policy").get("timing", {})
    return {"rollout": float(t_roll.get("generate_s", 0.0)),
            "optimize": float(t_opt.get("old_logprobs_s", 0.0)) + float(t_opt.get("loop_s", 0.0))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--prefect", action="store_true", help="run under the Prefect flow")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from rlpipe.pipelines.cli import _quiet_libraries
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.pipelines.runner import Pipeline
    from rlpipe.schemas import iteration_dir_name

    _quiet_libraries()
    preset = load_preset(args.preset, [f"iterations={args.iterations}", "eval_every=0", *args.overrides])
    run_dir = Path(tempfile.mkdtemp(prefix="bench_pipeline_")) / preset.name
    records = []
    if args.prefect:
        from rlpipe.flows import run_flow as rf

        original = rf.Pipeline

        class Recording(original):  # keep the records the flow's pipeline produces
            def run(self):
                out = super().run()
                records.extend(out)
                return out

        rf.Pipeline = Recording
        rf.run_flow(preset, str(run_dir))
    else:
        records = Pipeline(preset, run_dir, log=lambda s: None).run()

    stages = ["rollout", "score", "advantage", "optimize", "evaluate"]
    print(f"\npreset {preset.name}, {'Prefect flow' if args.prefect else 'local runner'}, "
          f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs")
    print(f"{'iter':>4} " + " ".join(f"{s:>9}" for s in stages) + f" {'total':>7} {'compute':>8} {'outside':>8}")
    outside_fracs, totals = [], []
    for r in records:
        comp = _compute_seconds(run_dir / iteration_dir_name(r.iteration))
        total = r.seconds["total"]
        compute = sum(comp.values())
        frac = 1 - compute / total
        print(f"{r.iteration:>4} " + " ".join(f"{r.seconds.get(s, 0.0):>9.3f}" for s in stages)
              + f" {total:>7.3f} {compute:>8.3f} {frac:>8.1%}")
        if r.iteration > 0:
            outside_fracs.append(frac)
            totals.append(total)
    if totals:
        print(f"\nsteady state (iterations 1..{records[-1].iteration}): median {statistics.median(totals):.3f} s "
              f"per iteration, median {statistics.median(outside_fracs):.1%} outside the stages' compute")
        per_stage = {s: statistics.median(r.seconds.get(s, 0.0) for r in records[1:]) for s in stages}
        print("median seconds per stage: " + ", ".join(f"{s} {v:.3f}" for s, v in per_stage.items()))
    print(f"run directory: {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
