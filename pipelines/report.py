"""What a run shows: ONE summary per iteration, and the report built from it.

Everything is read back from the run's artifacts, so the summary of a finished,
resumed or still-running run is the same, and the console line, `rlpipe inspect`, the report
(runs/<run>/report/: curves.png, metrics.md, index.html), the metric sinks (`sinks.py`) and the
Prefect artifacts all show these numbers, under these names (their labels: `display.py`):

- Numbering: iteration k of the code (directory iter_{k:04d}, the `iteration` column of its
  rollouts and metrics) is SHOWN as n = k + 1 (`shown_iteration`): the number of iterations
  completed when it ends, as in "iter 2/2" and as the evaluate stage counts (its artifact after
  iteration k is tagged k + 1, and the evaluation before training, eval_0000, sits at n = 0).
- Aggregation: an optimiser metric of an iteration is the MEAN over its optimizer steps (step >= 1
  of its metrics artifact); a once-per-stage value (step 0) is taken as is. The mean describes the
  whole update made with the iteration's rollouts (how far the policy moved, which fraction of
  tokens was clipped, over every minibatch and epoch), as PPO implementations report it; the
  last step alone is one minibatch, noisier, and with several epochs the most off-policy one.
  With one step per iteration the two coincide.
- approx_kl and clip_fraction (KL to, and ratio clipping against, the rollout policy) are left
  out of an iteration with a single optimizer step on recomputed old log-probs: that step runs
  the rollout policy itself (ratio exactly 1), so they are 0 by construction and say nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlpipe.pipelines.display import COLUMNS, NOTE, format_value, printable
from rlpipe.pipelines.report_html import render_html
from rlpipe.schemas import MANIFEST_NAME, ArtifactError, exists, read_manifest, read_table_artifact
from rlpipe.schemas.atomic import write_if_changed
from rlpipe.schemas.rollouts import GREEDY_SAMPLE_INDEX, sampled_lengths
from rlpipe.schemas.runs import INITIAL_EVAL_DIR, iteration_dir_name, iteration_dirs

#: The component a preset names `correct` (an answer-match verifier) is shown as accuracy.
ACCURACY_COMPONENT = "reward__correct"

#: Optimiser metrics of the summary (means over the iteration's optimizer steps).
OPTIMIZER_METRICS = ("loss", "kl_ref", "approx_kl", "clip_fraction", "entropy", "grad_norm",
                     "value_loss", "value_clip_fraction", "explained_variance")

#: Measured against the rollout policy: identically 0 on the first optimizer step of an iteration.
ROLLOUT_POLICY_METRICS = ("approx_kl", "clip_fraction", "dual_clip_fraction")

#: Panels of curves.png, in order; a panel shows only when its column has data.
PANELS = ("reward_mean", "accuracy", "eval_accuracy", "kl_ref", "approx_kl", "clip_fraction",
          "entropy", "response_length", "tool_calls_mean", "value_loss", "explained_variance", "value_clip_fraction")

#: Sample completions per iteration given to the sinks and shown in the HTML report.
SAMPLES_PER_ITERATION = 8


def shown_iteration(k: int) -> int:
    """The number iteration k (directory iter_{k:04d}) is shown as: k + 1 (see the module doc)."""
    return k + 1


def step_metrics(metrics_dir: Path | str) -> dict[str, float]:
    """Every metric of an optimize `metrics` artifact, one value each: the mean over optimizer
    steps (step >= 1) of a per-step metric, the value of a once-per-stage one (step 0); without
    the rollout-policy metrics when they are 0 by construction (see the module doc)."""
    # (plain Python over the columns, not Arrow compute or Polars: this runs after every
    # iteration on the driver's critical path over a table of a row per step and metric; here
    # 0.15 ms against Arrow's filters and group-by 0.7 ms, a Polars frame ~1 ms to build)
    m = read_table_artifact(metrics_dir, columns=["step", "name", "value"])
    out: dict[str, float] = {}
    sums: dict[str, list[float]] = {}
    step_numbers = m["step"].to_pylist()
    for step, name, value in zip(step_numbers, m["name"].to_pylist(), m["value"].to_pylist(), strict=True):
        if step == 0:
            out[name] = float(value)
        else:
            sums.setdefault(name, []).append(value)
    out.update({name: math.fsum(values) / len(values) for name, values in sums.items()})
    steps = out.get("steps", float(len({s for s in step_numbers if s > 0})))
    out["optimizer_steps"] = steps
    config = read_manifest(metrics_dir).config or {}
    if steps == 1 and config.get("recompute_old_logprobs", False):
        for name in ROLLOUT_POLICY_METRICS:
            out.pop(name, None)
    return out


def iteration_metrics(run_dir: Path | str, k: int) -> dict[str, float]:
    """The summary of iteration k (without stage times): reward, accuracy (scores), response
    length and truncation (rollouts), optimiser metrics (metrics), held-out metrics (eval)."""
    import numpy as np
    import pyarrow.compute as pc

    it = Path(run_dir) / iteration_dir_name(k)
    out: dict[str, float] = {}
    if exists(it / "scores"):
        s = read_table_artifact(it / "scores")
        out["reward_mean"] = float(pc.mean(s["reward"]).as_py())
        out["reward_std"] = float(pc.stddev(s["reward"], ddof=1).as_py() or 0.0)
        if ACCURACY_COMPONENT in s.column_names:  # (NaN: a row a TRL-style function left out)
            out["accuracy"] = float(np.nanmean(s[ACCURACY_COMPONENT].to_numpy()))
    if exists(it / "rollouts"):
        t = read_table_artifact(it / "rollouts", columns=["response_token_ids", "response_mask", "finish_reason",
                                                           "iteration", "policy_version", "num_turns", "turns"])
        if t.num_rows:
            lengths = sampled_lengths(t["response_mask"], pc.list_value_length(t["response_token_ids"]).to_pylist(),
                                      what=f"{it / 'rollouts'}: column 'response_mask'")
            out["response_length"] = sum(lengths) / t.num_rows  # the model's tokens, not the environment's
            out["truncated_fraction"] = float(pc.mean(pc.equal(t["finish_reason"], "length")).as_py())
            if t["num_turns"].null_count < t.num_rows:  # episodes: how the policy uses the environment
                out.update(_episode_metrics(t))
            stale = pc.max(pc.subtract(t["iteration"], t["policy_version"])).as_py()
            if stale > 0:  # asynchronous runs: the sampling policy is this many optimize runs behind
                out["staleness"] = float(stale)
    if exists(it / "metrics"):
        steps = step_metrics(it / "metrics")
        out.update({n: steps[n] for n in (*OPTIMIZER_METRICS, "optimizer_steps") if n in steps})
        if "logprob_gap_mean_abs" in steps and "staleness" in out:  # (shows the staleness's effect)
            out["logprob_gap_mean_abs"] = steps["logprob_gap_mean_abs"]
    if exists(it / "eval"):
        for name, value in eval_metrics(it / "eval").items():
            out[f"eval_{name}"] = value
    return out


def _episode_metrics(rollouts: Any) -> dict[str, float]:
    """turns_mean and tool_calls_mean of multi-turn episodes (the rollouts' episode columns)."""
    import polars as pl

    r = pl.from_arrow(rollouts.select(["num_turns", "turns"]))
    calls = r["turns"].list.eval(pl.element().struct.field("tool_calls").list.len()).list.sum()
    return {"turns_mean": float(r["num_turns"].mean()), "tool_calls_mean": float(calls.mean())}


def stage_seconds(iteration_dir: Path) -> dict[str, float]:
    """seconds_<stage>: wall time of each stage of an iteration, from its artifacts' manifests (a
    stage writing several artifacts, optimize: policy, critic, metrics, counts once; its train
    state, written in the background while the next stages run, does not count)."""
    wall: dict[str, float] = {}
    for art in sorted(p for p in iteration_dir.iterdir() if (p / MANIFEST_NAME).is_file()):
        try:
            m = read_manifest(art)
        except ArtifactError:
            continue
        if m.extra.get("kind") == "train_state":
            continue
        wall[f"seconds_{m.stage}"] = max(wall.get(f"seconds_{m.stage}", 0.0), m.wall_time_s)
    return wall


#: iteration directory -> (its fingerprint, its row): the live report and the sinks rebuild the
#: run table after every iteration; without this, iteration n re-reads every artifact of the n - 1
#: before it (measured: 0.27 s per iteration at 20 iterations, growing linearly with the run).
_ROWS: dict[str, tuple[tuple, dict[str, float]]] = {}


def _fingerprint(iteration_dir: Path) -> tuple:
    """What an iteration's row is computed from: each artifact's manifest, by name, size and
    modification time. A manifest is written last and renamed into place, so any rewrite of an
    artifact (a rerun, --force, a new stage) changes it."""
    stats = []
    for art in sorted(iteration_dir.iterdir()):
        try:
            st = (art / MANIFEST_NAME).stat()
        except (FileNotFoundError, NotADirectoryError):
            continue
        stats.append((art.name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(stats)


def iteration_row(run_dir: Path | str, k: int) -> dict[str, float]:
    """One row of `run_table`: the shown iteration number, the summary and the stage times
    (computed once per state of the iteration's artifacts)."""
    it = Path(run_dir) / iteration_dir_name(k)
    key, fingerprint = str(it.resolve()), _fingerprint(it)
    cached = _ROWS.get(key)
    if cached is not None and cached[0] == fingerprint:
        return dict(cached[1])
    row = {"iteration": shown_iteration(k), **iteration_metrics(run_dir, k), **stage_seconds(it)}
    _ROWS[key] = (fingerprint, row)
    return dict(row)


def eval_metrics(path: Path | str) -> dict[str, float]:
    """The scalar metrics of an evaluate artifact (name -> value)."""
    import polars as pl

    m = pl.from_arrow(read_table_artifact(path))
    return {name: float(value) for name, value in m.select("name", "value").iter_rows()}


def run_table(run_dir: Path | str):
    """One row per iteration (`iteration_row`), columns in the order of COLUMNS."""
    import polars as pl

    rows = [iteration_row(run_dir, k) for k, _ in iteration_dirs(run_dir)]
    if not rows:
        return pl.DataFrame()
    seen = {c for r in rows for c in r}
    order = [c for c in COLUMNS if c in seen]
    order += sorted(c for c in seen if c.startswith("eval_") and c not in COLUMNS)
    order += sorted(c for c in seen if c.startswith("seconds_"))
    order += sorted(seen - set(order))
    return pl.DataFrame([{c: r.get(c) for c in order} for r in rows],
                        schema={c: pl.Int64 if c == "iteration" else pl.Float64 for c in order})


def sample_completions(run_dir: Path | str, k: int, n: int = SAMPLES_PER_ITERATION):
    """n completions of iteration k, one per prompt first (sample 0 of groups 0, 1, ..., then
    sample 1 of each, ...), so a page of them shows n different prompts: prompt, response, reward
    (from scores; null before scoring), answer and finish reason."""
    import polars as pl

    it = Path(run_dir) / iteration_dir_name(k)
    cols = ["group_id", "sample_index", "prompt", "response", "answer", "finish_reason", "num_turns", "turns"]
    r = pl.from_arrow(read_table_artifact(it / "rollouts", columns=cols))
    r = r.filter(pl.col("sample_index") != GREEDY_SAMPLE_INDEX)  # ReMax's baselines are no samples
    r = r.sort("sample_index", "group_id").head(n)
    episodes = r["num_turns"].null_count() < r.height
    if episodes:  # an episode's response is shown turn by turn
        r = r.with_columns(pl.Series("response", [response if turns is None else episode_lines(turns) for
                                                  response, turns in zip(r["response"], r["turns"], strict=True)]))
    if exists(it / "scores"):
        s = pl.from_arrow(read_table_artifact(it / "scores", columns=["group_id", "sample_index", "reward"]))
        r = r.join(s, on=["group_id", "sample_index"], how="left")
    else:
        r = r.with_columns(pl.lit(None, pl.Float64).alias("reward"))
    shown = ["prompt", "response", pl.col("reward").cast(pl.Float64), "answer", "finish_reason"]
    return r.select(*shown, pl.col("num_turns").alias("turns")) if episodes else r.select(*shown)


def episode_lines(turns: list[dict[str, Any]]) -> str:
    """An episode turn by turn, a line each (within a line, control characters escaped):
    'model: <text>', 'tool <name>: <result>' for each tool result, or 'environment: <reply>'."""
    lines = []
    for t in turns:
        if t["role"] == "model":
            ended = "" if t["finish_reason"] == "stop" else f" [{t['finish_reason']}]"
            lines.append(f"model{ended}: {printable(t['text'])}")
        elif t["tool_results"]:
            lines += [f"tool {r['name']}: {printable(r['content'])}" for r in t["tool_results"]]
        else:
            lines.append(f"environment: {printable(t['text'])}")
    return "\n".join(lines)


def shown_panels(table) -> list[str]:
    """The PANELS that carry information for this run: columns present with at least one value."""
    return [p for p in PANELS if p in table.columns and table[p].drop_nulls().len() > 0]


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------
def write_report(run_dir: Path | str, *, live: bool = False, plot: bool = True) -> Path:
    """Write report/curves.png, report/metrics.md and report/index.html; returns the folder.

    `live`: the run is still going (the page reloads itself every REFRESH_SECONDS). `plot=False`
    keeps the curves.png there is (a live report between re-plots: the matplotlib render costs more
    than the tables). Each file is written beside and renamed into place (when it changed), so a
    reader never sees half a file."""
    return render_report(report_inputs(run_dir), live=live, plot=plot)


@dataclass(frozen=True)
class ReportInputs:
    """What a report shows, read from the run (`report_inputs`): `render_report` reads nothing
    else of it, so a live report renders in a thread while the run goes on (sinks.RunMonitor)."""

    run_dir: Path
    table: Any
    """`run_table`"""
    initial: dict[str, float]
    """the held-out metrics before training (empty without that evaluation)"""
    samples: tuple[int, Any] | None
    """(shown iteration, `sample_completions`) of the latest iteration with rollouts"""


def report_inputs(run_dir: Path | str) -> ReportInputs:
    run_dir = Path(run_dir)
    initial = eval_metrics(run_dir / INITIAL_EVAL_DIR) if exists(run_dir / INITIAL_EVAL_DIR) else {}
    latest = next((k for k, d in reversed(iteration_dirs(run_dir)) if exists(d / "rollouts")), None)
    samples = None if latest is None else (shown_iteration(latest), sample_completions(run_dir, latest))
    return ReportInputs(run_dir, run_table(run_dir), initial, samples)


def render_report(inputs: ReportInputs, *, live: bool = False, plot: bool = True) -> Path:
    """The report's files from `inputs` (see `write_report`); returns the folder."""
    name, table, initial = inputs.run_dir.name, inputs.table, inputs.initial
    out = inputs.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    if plot or not (out / "curves.png").is_file():
        png = plot_curves(table, initial, f"rlpipe run {name}")
        write_if_changed(out / "curves.png", png)
    else:
        png = (out / "curves.png").read_bytes()
    lines = [f"# Run {name}", "", NOTE, ""]
    if initial:
        lines += ["Held-out before training: " + ", ".join(f"{k} {v:.3f}" for k, v in initial.items()), ""]
    lines.append(markdown_table(table))
    write_if_changed(out / "metrics.md", ("\n".join(lines) + "\n").encode())
    page = render_html(name, table, png, initial, inputs.samples, live=live)
    write_if_changed(out / "index.html", page.encode())
    return out


def plot_curves(table, initial: dict[str, float], title: str) -> bytes:
    """curves.png, as bytes (see `curves_figure`)."""
    import io

    fig = curves_figure(table, initial, title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()


def curves_figure(table, initial: dict[str, float], title: str):
    """One panel per `shown_panels` column against the shown iteration, integer ticks; held-out
    accuracy starts at 0 with the evaluation before training."""
    # A bare Figure, not pyplot: no global figure registry, so a thread may render it (a live
    # report) and nothing needs closing.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = shown_panels(table) if not table.is_empty() else []
    cols = 4
    rows = max((len(panels) + cols - 1) // cols, 1)
    # constrained layout: laid out during the one draw savefig makes (tight_layout draws twice)
    fig = Figure(figsize=(4 * cols, 3 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, key in zip(axes.flat, panels, strict=False):
        data = table.select("iteration", key).drop_nulls()
        x, y = data["iteration"].to_list(), data[key].to_list()
        if key == "eval_accuracy" and "accuracy" in initial:
            x, y = [0, *x], [initial["accuracy"], *y]
        ax.plot(x, y, marker="o" if len(x) < 40 else None)
        ax.set_title(COLUMNS[key][1])
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if not panels:
        axes.flat[0].text(0.5, 0.5, "no iterations yet", ha="center", va="center")
    fig.suptitle(title)
    return fig


def markdown_table(table) -> str:
    """A Polars DataFrame as a markdown table (floats to 4 significant digits)."""
    if table.is_empty():
        return "(no iterations yet)"
    head = "| " + " | ".join(table.columns) + " |"
    sep = "|" + "---|" * len(table.columns)
    body = ["| " + " | ".join(format_value(v) for v in row) + " |" for row in table.iter_rows()]
    return "\n".join([head, sep, *body])
