"""What verified reads cost: every stage of a run checks its inputs' files against the sha256
their manifests hold before it uses them (schemas/verify.py). This measures that check, cold (no
hash remembered), against each stage's own wall time.

    python benchmarks/bench_verify.py [--run runs/demo] [--iterations 2] [--repeat 3]

Without `--run`, the built-in demo preset runs `--iterations` iterations in-process into a
temporary directory first (its SFT takes about a minute). Then, for every stage manifest of the
run, each input artifact's listed files are verified `--repeat` times with the in-process hash
memo cleared (best time kept), and compared with the stage's wall time from its manifest. A
stage run in the pipeline pays at most this (a file it verified before is not hashed again while
its stat is unchanged). Files are read from the page cache: the figure is hashing, not the disk.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from rlpipe.schemas import read_manifest
from rlpipe.schemas import verify as V
from rlpipe.schemas.manifest import MANIFEST_NAME


def verify_inputs(inputs: list[Path], repeat: int) -> tuple[float, int]:
    """Best-of-`repeat` seconds to verify every listed file of `inputs` cold, and their bytes."""
    best, size = float("inf"), 0
    for _ in range(repeat):
        V.forget_verified()  # cold: nothing remembered from an earlier check, here or on the machine
        started, size = time.perf_counter(), 0
        for path in inputs:
            manifest = read_manifest(path)
            for info in manifest.files:
                V.verify_file(path / info.name, info)
                size += info.bytes
        best = min(best, time.perf_counter() - started)
    return best, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="an existing run directory (default: run the demo first)")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    run = args.run
    if run is None:
        from rlpipe.pipelines.preset import load_preset
        from rlpipe.pipelines.runner import Pipeline

        run = Path(tempfile.mkdtemp(prefix="bench-verify-")) / "demo"
        print(f"running the demo ({args.iterations} iterations) into {run} ...", flush=True)
        Pipeline(load_preset("demo", [f"iterations={args.iterations}"]), run, log=lambda s: None).run()

    # One entry per stage run: a stage with several outputs (optimize: policy, metrics, train
    # state) shares one cache key; its wall time is the longest of its manifests' (the last one
    # written), its inputs are the same for all.
    runs: dict[tuple[str, str | None], tuple[float, list[Path]]] = {}
    for m in sorted(run.rglob(MANIFEST_NAME)):
        folder = m.parent
        if any(p.startswith(".") for p in folder.relative_to(run).parts):
            continue
        manifest = read_manifest(folder)
        # Input paths as the stage was given them (absolute in a pipeline run); a file input (a
        # preset's data file) has no manifest to verify against.
        inputs = [Path(ref.path) for ref in manifest.inputs.values()]
        inputs = [p for p in inputs if (p / MANIFEST_NAME).is_file()]
        key = (manifest.stage, manifest.cache_key)
        runs[key] = (max(manifest.wall_time_s, runs.get(key, (0.0, []))[0]), inputs)

    per_stage: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])  # wall, verify, bytes, n
    for (stage, _), (wall, inputs) in runs.items():
        if wall <= 0:
            continue
        seconds, size = verify_inputs(inputs, args.repeat)
        row = per_stage[stage]
        row[0] += wall
        row[1] += seconds
        row[2] += size
        row[3] += 1

    print(f"\nrun {run}: verifying each stage's inputs cold (best of {args.repeat}) vs the stage's wall time")
    print(f"{'stage':<14}{'runs':>5}{'input MB':>10}{'verify s':>10}{'stage s':>10}{'ratio':>9}")
    total_wall = total_verify = 0.0
    for stage, (wall, verify, size, n) in sorted(per_stage.items()):
        total_wall += wall
        total_verify += verify
        print(f"{stage:<14}{n:>5}{size / 1e6:>10.1f}{verify:>10.3f}{wall:>10.2f}{verify / wall:>8.1%}")
    print(f"{'all':<14}{'':>5}{'':>10}{total_verify:>10.3f}{total_wall:>10.2f}{total_verify / total_wall:>8.1%}")


if __name__ == "__main__":
    main()
