"""What a run shows: headline metrics per iteration, and a report (curves as PNG + a markdown
table) written into runs/<run>/report/. Everything is read back from the run's artifacts with
Polars, so the report of a finished, resumed or still-running run is the same.
"""

from __future__ import annotations

from pathlib import Path

from rlpipe.schemas import exists, read_manifest, read_table_artifact
from rlpipe.schemas.runs import INITIAL_EVAL_DIR, iteration_dir_name, iteration_dirs

#: The component a preset names `correct` (an answer-match verifier) is shown as accuracy.
ACCURACY_COMPONENT = "reward__correct"

#: Optimiser metrics averaged over the steps of an iteration, as shown in the metrics line.
STEP_METRICS = ("loss", "approx_kl", "kl_ref", "entropy", "clip_fraction", "grad_norm", "value_loss",
                "explained_variance")


def iteration_metrics(run_dir: Path | str, k: int) -> dict[str, float]:
    """Headline numbers of iteration k: reward, accuracy, length, truncation (from scores),
    optimiser means (from metrics) and the held-out accuracy when it was evaluated."""
    import polars as pl

    it = Path(run_dir) / iteration_dir_name(k)
    out: dict[str, float] = {}
    if exists(it / "scores"):
        s = pl.from_arrow(read_table_artifact(it / "scores"))
        out["reward_mean"] = float(s["reward"].mean())
        out["reward_std"] = float(s["reward"].std() or 0.0)
        out["response_length"] = float(s["response_length"].mean())
        out["truncated_fraction"] = float((s["finish_reason"] == "length").mean())
        if ACCURACY_COMPONENT in s.columns:
            out["accuracy"] = float(s[ACCURACY_COMPONENT].mean())
    if exists(it / "metrics"):
        m = pl.from_arrow(read_table_artifact(it / "metrics"))
        steps = m.filter(pl.col("step") > 0).group_by("name").agg(pl.col("value").mean())
        for name, value in steps.iter_rows():
            if name in STEP_METRICS:
                out[name] = float(value)
    if exists(it / "eval"):
        for name, value in eval_metrics(it / "eval").items():
            out[f"eval_{name}"] = value
    return out


def eval_metrics(path: Path | str) -> dict[str, float]:
    """The scalar metrics of an evaluate artifact (name -> value)."""
    import polars as pl

    m = pl.from_arrow(read_table_artifact(path))
    return {name: float(value) for name, value in m.select("name", "value").iter_rows()}


def run_table(run_dir: Path | str):
    """One row per iteration with every headline metric and the wall time of each stage."""
    import polars as pl

    run_dir = Path(run_dir)
    rows = []
    for k, it in iteration_dirs(run_dir):
        row: dict[str, float] = {"iteration": k, **iteration_metrics(run_dir, k)}
        for stage in ("rollouts", "scores", "reference", "advantages", "policy", "eval"):
            if exists(it / stage):
                row[f"seconds_{stage}"] = read_manifest(it / stage).wall_time_s
        rows.append(row)
    return pl.DataFrame(rows) if rows else pl.DataFrame()


def write_report(run_dir: Path | str) -> Path:
    """Write report/curves.png and report/metrics.md for the run; returns the report folder."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    table = run_table(run_dir)
    initial = eval_metrics(run_dir / INITIAL_EVAL_DIR) if exists(run_dir / INITIAL_EVAL_DIR) else {}
    panels = [("reward_mean", "reward (mean)"), ("accuracy", "train accuracy"),
              ("eval_accuracy", "held-out accuracy"), ("kl_ref", "KL to reference"),
              ("approx_kl", "approx KL to old"), ("entropy", "entropy"),
              ("response_length", "response length"), ("clip_fraction", "clip fraction")]
    panels = [(k, t) for k, t in panels if k in table.columns]
    n = max(len(panels), 1)
    cols = 4
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels, strict=False):
        data = table.select("iteration", key).drop_nulls()
        x = (data["iteration"] + 1).to_list()
        y = data[key].to_list()
        if key == "eval_accuracy" and "accuracy" in initial:
            x, y = [0, *x], [initial["accuracy"], *y]
        ax.plot(x, y, marker="o" if len(x) < 40 else None)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"rlpipe run {run_dir.name}")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=80)
    plt.close(fig)
    lines = [f"# Run {run_dir.name}", ""]
    if initial:
        lines.append("Held-out before training: " + ", ".join(f"{k} {v:.3f}" for k, v in initial.items()))
        lines.append("")
    lines.append(markdown_table(table))
    (out / "metrics.md").write_text("\n".join(lines) + "\n")
    return out


def markdown_table(table) -> str:
    """A Polars DataFrame as a markdown table (floats to 4 significant digits)."""
    if table.is_empty():
        return "(no iterations yet)"
    head = "| " + " | ".join(table.columns) + " |"
    sep = "|" + "---|" * len(table.columns)
    body = []
    for row in table.iter_rows():
        cells = ["" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)) for v in row]
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, sep, *body])
