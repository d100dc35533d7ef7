"""Padding against packing: the padding fraction and the seconds of optimize and reference on
long-tailed lengths, the same rows both ways.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_packing.py [--jobs smol demo_tools] [--repeats 3] [--json FILE]

For each job (a built-in preset) one iteration of the preset runs first (`--local`, in a temporary
run directory) for its rollouts: `smol` is the real pretrained model (SmolLM2-135M-Instruct, `make
smol-model` first) answering in up to 128 tokens, where some samples stop after a few and others
run to the limit; `demo_tools` the tiny model's tool-use episodes (environment tokens inside the
responses). Then on that iteration's rollouts and advantages, alternating, `--repeats` times each:

    optimize   the stage with `packing` false then true (its training loop and old-log-prob pass:
               the manifest's timing, loop_s + old_logprobs_s; set-up and saves excluded);
    reference  the stage with the run's starting policy as the reference model, `packing` false
               then true (wall time of the stage, the model already loaded).

The padding fraction is that of every forward pass the two stages made (positions computed that
hold no token, over positions computed), counted where the passes are built (`forward.pack`).
Medians of the repeats; the speedup is (optimize + reference) padded over packed. One torch thread.
JSON: {"<job>": {"padding_fraction": {"padded": x, "packed": y}, "speedup": s, "seconds": {...}}}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

PRESET_OVERRIDES = {"smol": ["iterations=1", "eval_every=0", "sft=null"],
                    "demo_tools": ["iterations=1", "eval_every=0"]}


class PaddingCount:
    """Positions computed and tokens held by the forward passes built while it is installed."""

    def __init__(self):
        self.computed = self.tokens = 0

    def __enter__(self):
        from rlpipe.stages.common import forward
        from rlpipe.stages.optimize import training

        real = forward.pack

        def counted(prompts, responses, pad_id, sampled=None, *, packed=False):
            batch = real(prompts, responses, pad_id, sampled, packed=packed)
            self.computed += batch.tokens
            self.tokens += sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
            return batch

        self._restore = [(forward, "pack", real), (training, "pack", training.pack)]
        forward.pack = training.pack = counted
        return self

    def __exit__(self, *exc):
        for module, name, value in self._restore:
            setattr(module, name, value)

    @property
    def fraction(self) -> float:
        return 1 - self.tokens / self.computed if self.computed else 0.0


def _first_iteration(job: str, root: Path) -> Path:
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.pipelines.runner import Pipeline

    run_dir = root / job
    Pipeline(load_preset(job, PRESET_OVERRIDES.get(job, ["iterations=1"])), run_dir, log=lambda line: None).run()
    return run_dir


def _optimize(run_dir: Path, out: Path, packing: bool) -> float:
    from rlpipe.schemas import read_manifest
    from rlpipe.schemas.config_files import load_config
    from rlpipe.stages.common.process_state import reset_process_state
    from rlpipe.stages.optimize.config import OptimizeConfig
    from rlpipe.stages.optimize.run import run

    reset_process_state()  # (no warm engine: each variant starts as a fresh optimize run)
    config = load_config(OptimizeConfig, run_dir / "iter_0000" / "configs" / "optimize.yaml",
                         [f"output={out / 'policy'}", f"metrics_output={out / 'metrics'}", "train_state_output=null",
                          f"packing={str(packing).lower()}"])
    run(config, force=True)
    timing = read_manifest(out / "policy").extra["timing"]
    return timing["loop_s"] + timing["old_logprobs_s"]


def _reference(run_dir: Path, out: Path, packing: bool) -> float:
    from rlpipe.schemas.config_files import load_config, parse_config
    from rlpipe.stages.common.models import load_model
    from rlpipe.stages.reference.config import ReferenceConfig
    from rlpipe.stages.reference.run import run
    from rlpipe.stages.rollout.config import RolloutConfig

    # the starting policy: what iteration 0's rollout sampled from
    start = load_config(RolloutConfig, run_dir / "iter_0000" / "configs" / "rollout.yaml").checkpoint
    load_model(start)  # (loaded before the clock starts: the stage takes it from the cache)
    config = parse_config(ReferenceConfig, {"rollouts": run_dir / "iter_0000" / "rollouts", "reference_model": start,
                                            "output": out / "reference", "packing": packing})
    began = time.perf_counter()
    run(config, force=True)
    return time.perf_counter() - began


def measure(job: str, repeats: int, root: Path) -> dict[str, Any]:
    run_dir = _first_iteration(job, root)
    seconds: dict[str, dict[str, list[float]]] = {s: {"padded": [], "packed": []} for s in ("optimize", "reference")}
    counts = {"padded": PaddingCount(), "packed": PaddingCount()}
    for r in range(repeats):
        for variant in ("padded", "packed"):
            out = root / f"{job}-{variant}-{r}"
            with counts[variant] if r == 0 else contextlib.nullcontext():
                seconds["optimize"][variant].append(_optimize(run_dir, out, variant == "packed"))
                seconds["reference"][variant].append(_reference(run_dir, out, variant == "packed"))
    median = {stage: {v: statistics.median(x) for v, x in by.items()} for stage, by in seconds.items()}
    total = {v: median["optimize"][v] + median["reference"][v] for v in ("padded", "packed")}
    return {"padding_fraction": {v: round(c.fraction, 4) for v, c in counts.items()},
            "speedup": round(total["padded"] / total["packed"], 3),
            "seconds": {stage: {v: round(s, 3) for v, s in by.items()} for stage, by in median.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", nargs="+", default=["smol", "demo_tools"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_packing-") as tmp:
        for job in args.jobs:
            results[job] = measure(job, args.repeats, Path(tmp))
            print(f"{job}: {json.dumps(results[job])}", flush=True)
    print(f"\n{'job':>11} {'padding padded':>15} {'packed':>7} {'optimize s padded/packed':>25} "
          f"{'reference s padded/packed':>26} {'speedup':>8}")
    for job, f in results.items():
        o, r = f["seconds"]["optimize"], f["seconds"]["reference"]
        print(f"{job:>11} {f['padding_fraction']['padded']:>15.1%} {f['padding_fraction']['packed']:>7.1%} "
              f"{o['padded']:>12.3f} / {o['packed']:<10.3f} {r['padded']:>12.3f} / {r['packed']:<11.3f} "
              f"{f['speedup']:>7.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
