"""`rlpipe inspect`: readable summaries of a table artifact, a checkpoint or a whole run.

The numbers come from plain functions (`table_stats`, `run_summary`) that return dicts and Polars
frames, so tests check values; `inspect_path` renders them with rich. Everything is read with
Polars through `rlpipe.schemas` (schemas checked), only the columns a statistic needs.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl
from rich.console import Console
from rich.table import Table

from rlpipe.schemas import (
    MANIFEST_NAME,
    ArtifactError,
    ArtifactNotFound,
    Manifest,
    read_manifest,
    scan_artifact,
    scan_run,
)
from rlpipe.schemas.runs import iteration_dirs, iteration_index

#: Metrics shown per iteration when a run's metrics artifacts log them (ALGORITHMS.md section 7),
#: in this order; `--metric NAME` adds others.
DEFAULT_METRICS = ("policy_loss", "approx_kl", "kl", "kl_ref", "entropy", "clip_fraction",
                   "grad_norm", "value_loss", "accuracy")
MAX_CELL = 48  # characters of text shown per sample cell
MAX_ITEMS = 6  # list items shown per sample cell


# ---------------------------------------------------------------------------------------------
# What is at a path
# ---------------------------------------------------------------------------------------------
def kind_of(path: Path) -> str:
    """'table', 'checkpoint' or 'run'; raises ArtifactNotFound for anything else."""
    path = Path(path)
    if (path / MANIFEST_NAME).is_file():
        return read_manifest(path).kind
    if path.is_dir() and iteration_dirs(path):
        return "run"
    if not path.exists():
        raise ArtifactNotFound(f"{path} does not exist")
    raise ArtifactNotFound(
        f"{path} is neither an artifact (no {MANIFEST_NAME}: missing or its stage did not finish) "
        f"nor a run directory (no iter_NNNN/ inside)"
    )


# ---------------------------------------------------------------------------------------------
# Table artifacts
# ---------------------------------------------------------------------------------------------
def _stats(col: pl.Expr, name: str) -> list[pl.Expr]:
    return [col.mean().alias(f"{name}:mean"), col.std().alias(f"{name}:std"),
            col.min().cast(pl.Float64).alias(f"{name}:min"), col.max().cast(pl.Float64).alias(f"{name}:max")]


def table_stats(lf: pl.LazyFrame) -> dict[str, Any]:
    """Statistics of the columns present, in one pass over only the columns needed.

    Returns a dict with 'rows', 'stats' ({quantity: {mean, std, min, max}} for `reward`,
    `advantage`, response length from `response_token_ids` or `response_length`),
    'components' ({reward__x: mean}) and 'finish_reasons' ({reason: fraction}).
    """
    names = lf.collect_schema().names()
    exprs = [pl.len().alias("rows")]
    quantities = []
    for col in ("reward", "advantage"):
        if col in names:
            exprs += _stats(pl.col(col), col)
            quantities.append(col)
    if "response_token_ids" in names:
        exprs += _stats(pl.col("response_token_ids").list.len(), "response length")
        quantities.append("response length")
    elif "response_length" in names:
        exprs += _stats(pl.col("response_length"), "response length")
        quantities.append("response length")
    components = [n for n in names if n.startswith("reward__")]
    exprs += [pl.col(c).mean().alias(c) for c in components]
    row = lf.select(exprs).collect().row(0, named=True)
    rows = int(row["rows"])
    finish: dict[str, float] = {}
    if "finish_reason" in names and rows:
        counts = lf.group_by("finish_reason").len().sort("finish_reason").collect()
        finish = {str(r): n / rows for r, n in counts.iter_rows()}
    return {
        "rows": rows,
        "stats": {q: {s: row[f"{q}:{s}"] for s in ("mean", "std", "min", "max")} for q in quantities},
        "components": {c: row[c] for c in components},
        "finish_reasons": finish,
    }


def metric_summary(lf: pl.LazyFrame) -> pl.DataFrame:
    """Per (stage, name) of a metrics artifact: count, last value (highest iteration, step), min, max."""
    return (
        lf.sort("iteration", "step", maintain_order=True)
        .group_by("stage", "name", maintain_order=True)
        .agg(pl.len().alias("count"), pl.col("value").last().alias("last"),
             pl.col("value").min().alias("min"), pl.col("value").max().alias("max"))
        .sort("stage", "name")
        .collect()
    )


def _short(value: Any) -> str:
    """A cell of a sample row: long lists and text cut, with their length."""
    if value is None:
        return "null"
    if isinstance(value, list):
        head = ", ".join(_short(v) for v in value[:MAX_ITEMS])
        more = f", ... ({len(value)} items)" if len(value) > MAX_ITEMS else ""
        return f"[{head}{more}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={_short(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value).replace("\n", "\\n")
    return text if len(text) <= MAX_CELL else f"{text[:MAX_CELL]}... ({len(text)} chars)"


def _fmt(x: Any) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def _manifest_table(path: Path, m: Manifest) -> Table:
    t = Table(show_header=False, title=str(path), title_justify="left", box=None, padding=(0, 2))
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    if m.kind == "table":
        t.add_row("schema", f"{m.schema_name} v{m.schema_version}")
        t.add_row("rows", f"{m.rows} in {len(m.shard_names)} shard(s)")
    else:
        t.add_row("kind", "checkpoint")
    t.add_row("size", f"{sum(f.bytes for f in m.files) / 1e6:.2f} MB in {len(m.files)} file(s)")
    t.add_row("stage", m.stage)
    t.add_row("wall time", f"{m.wall_time_s:.2f} s")
    t.add_row("content hash", m.content_hash[:12])
    if m.inputs:
        t.add_row("inputs", ", ".join(f"{k}={v.content_hash[:12]}" for k, v in m.inputs.items()))
    t.add_row("created", f"{m.created_at} on {m.host or '?'} ({m.code_version or '?'})")
    return t


def show_table_artifact(path: Path, console: Console, sample_rows: int = 3) -> dict[str, Any]:
    """Print a table artifact's manifest, statistics and sample rows; returns the statistics."""
    m = read_manifest(path)
    console.print(_manifest_table(path, m))
    lf = scan_artifact(path)
    stats = table_stats(lf)
    if stats["stats"]:
        t = Table(title="statistics", title_justify="left")
        for c in ("quantity", "mean", "std", "min", "max"):
            t.add_column(c, justify="left" if c == "quantity" else "right")
        for q, v in stats["stats"].items():
            t.add_row(q, *(_fmt(v[s]) for s in ("mean", "std", "min", "max")))
        console.print(t)
    if stats["components"]:
        t = Table(title="reward components (unweighted means)", title_justify="left")
        t.add_column("component")
        t.add_column("mean", justify="right")
        for c, v in stats["components"].items():
            t.add_row(c.removeprefix("reward__"), _fmt(v))
        console.print(t)
    if stats["finish_reasons"]:
        parts = ", ".join(f"{r} {f:.1%}" for r, f in stats["finish_reasons"].items())
        console.print(f"finish reasons: {parts}", markup=False)
    if m.schema_name == "metrics" and stats["rows"]:
        summary = metric_summary(lf)
        t = Table(title="metrics", title_justify="left")
        for c in summary.columns:
            t.add_column(c, justify="right" if summary[c].dtype.is_numeric() else "left")
        for r in summary.iter_rows():
            t.add_row(*(_fmt(v) for v in r))
        console.print(t)
    if sample_rows and stats["rows"]:
        sample = lf.head(sample_rows).collect()
        t = Table(title=f"first {sample.height} row(s)", title_justify="left")
        t.add_column("column", style="bold", no_wrap=True)
        for i in range(sample.height):
            t.add_column(f"row {i}", overflow="fold")
        for col in sample.columns:
            t.add_row(col, *(_short(v) for v in sample[col].to_list()))
        console.print(t)
    return stats


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------
def safetensors_params(path: Path) -> int:
    """Number of parameters in the safetensors files of a directory, read from their headers."""
    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def show_checkpoint(path: Path, console: Console) -> dict[str, Any]:
    """Print a checkpoint's manifest, model config and parameter count (no torch import)."""
    m = read_manifest(path)
    console.print(_manifest_table(path, m))
    info: dict[str, Any] = {"params": safetensors_params(path)}
    cfg_file = path / "config.json"
    if cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text())
        for k in ("architectures", "model_type", "hidden_size", "num_hidden_layers",
                  "num_attention_heads", "vocab_size", "torch_dtype", "dtype"):
            if k in cfg:
                info[k] = cfg[k]
    t = Table(title="model", title_justify="left", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    for k, v in info.items():
        t.add_row(k, ", ".join(v) if isinstance(v, list) else f"{v:,}" if k == "params" else str(v))
    console.print(t)
    return info


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------
def _artifacts_by_schema(iters: Sequence[tuple[int, Path]]) -> dict[str, list[str]]:
    """schema name ('checkpoint' for checkpoints) -> artifact directory names, over all iterations."""
    found: dict[str, list[str]] = {}
    for _, d in iters:
        for art in sorted(p for p in d.iterdir() if (p / MANIFEST_NAME).is_file()):
            try:
                m = read_manifest(art)
            except ArtifactError:
                continue
            key = m.schema_name if m.kind == "table" and m.schema_name else m.kind
            if art.name not in found.setdefault(key, []):
                found[key].append(art.name)
    return found


def _pick(names: list[str], preferred: str) -> str | None:
    if not names:
        return None
    return preferred if preferred in names else names[0]


def run_summary(run_dir: Path, metrics: Sequence[str] = ()) -> pl.DataFrame:
    """One row per iteration of a run with whatever its artifacts hold.

    Columns (those that can be computed): iteration, artifacts (complete ones; incomplete ones
    marked '!'), wall_s (sum over stages of their longest artifact wall time), rollouts, groups, reward_mean,
    reward_std, response_len_mean, truncated (fraction finished by 'length'), then the last value
    of each metric in DEFAULT_METRICS (or `metrics`) logged by a metrics artifact in the iteration.
    """
    run_dir = Path(run_dir)
    iters = iteration_dirs(run_dir)
    rows = []
    for k, d in iters:
        complete, incomplete, wall = [], [], {}
        for art in sorted(p for p in d.iterdir() if p.is_dir()):
            if (art / MANIFEST_NAME).is_file():
                complete.append(art.name)
                try:
                    m = read_manifest(art)
                except ArtifactError:
                    continue
                # a stage writing several artifacts (optimize: policy, critic, metrics) counts once
                wall[m.stage] = max(wall.get(m.stage, 0.0), m.wall_time_s)
            else:
                incomplete.append(art.name + "!")
        rows.append({"iteration": k, "artifacts": " ".join(complete + incomplete), "wall_s": sum(wall.values())})
    out = pl.DataFrame(rows, schema={"iteration": pl.Int32, "artifacts": pl.String, "wall_s": pl.Float64})
    by_schema = _artifacts_by_schema(iters)

    rollouts = _pick(by_schema.get("rollouts", []), "rollouts")
    if rollouts:
        lf = scan_run(run_dir, rollouts, iteration_column="iteration_dir")
        agg = lf.group_by("iteration_dir").agg(
            pl.len().alias("rollouts"),
            pl.col("group_id").n_unique().alias("groups"),
            pl.col("response_token_ids").list.len().mean().alias("response_len_mean"),
            (pl.col("finish_reason") == "length").mean().alias("truncated"),
        )
        out = out.join(agg.collect().rename({"iteration_dir": "iteration"}), on="iteration", how="left")
    scores = _pick(by_schema.get("scores", []), "scores")
    if scores:
        lf = scan_run(run_dir, scores, iteration_column="iteration_dir")
        aggs = [pl.col("reward").mean().alias("reward_mean"), pl.col("reward").std().alias("reward_std")]
        if not rollouts:
            aggs += [pl.col("response_length").mean().alias("response_len_mean"),
                     (pl.col("finish_reason") == "length").mean().alias("truncated")]
        agg = lf.group_by("iteration_dir").agg(aggs).collect().rename({"iteration_dir": "iteration"})
        out = out.join(agg, on="iteration", how="left")

    frames = [scan_run(run_dir, name, iteration_column="iteration_dir")
              .with_columns(pl.lit(name).alias("artifact")) for name in by_schema.get("metrics", [])]
    if frames:
        long = pl.concat(frames, how="diagonal_relaxed").with_columns(
            pl.when(pl.col("artifact") == "metrics").then(pl.col("name"))
            .otherwise(pl.col("artifact") + "/" + pl.col("name")).alias("label")
        )
        last = (long.sort("iteration_dir", "step", maintain_order=True).group_by("iteration_dir", "label")
                .agg(pl.col("value").last()).collect())
        labels = set(last["label"].to_list())
        wanted = [n for n in DEFAULT_METRICS if n in labels]
        wanted += sorted(lb for lb in labels if "/" in lb and lb.split("/", 1)[1] in DEFAULT_METRICS)
        wanted += [n for n in metrics if n not in wanted]
        missing = [n for n in metrics if n not in labels]
        if missing:
            raise ArtifactError(f"metric(s) {missing} not logged in {run_dir}; logged: {sorted(labels)}")
        if wanted:
            wide = (last.filter(pl.col("label").is_in(wanted))
                    .pivot(on="label", index="iteration_dir", values="value")
                    .rename({"iteration_dir": "iteration"}))
            out = out.join(wide.select("iteration", *[w for w in wanted if w in wide.columns]),
                           on="iteration", how="left")
    elif metrics:
        raise ArtifactError(f"no metrics artifact in {run_dir}/iter_*/; cannot show {list(metrics)}")
    return out.sort("iteration")


def _other_artifacts(run_dir: Path) -> list[Path]:
    """Artifacts of a run outside its iteration directories (data/, models/, eval_0000/, ...)."""
    found = []
    for mf in sorted(run_dir.rglob(MANIFEST_NAME)):
        rel = mf.parent.relative_to(run_dir)
        if rel.parts and iteration_index(rel.parts[0]) is None:
            found.append(mf.parent)
    return found


def show_run(run_dir: Path, console: Console, metrics: Sequence[str] = ()) -> pl.DataFrame:
    """Print a run: its artifacts outside the iterations, then one row per iteration."""
    others = _other_artifacts(run_dir)
    if others:
        t = Table(title=f"{run_dir}: artifacts", title_justify="left")
        for c in ("artifact", "kind", "rows / files", "stage", "content"):
            t.add_column(c)
        for art in others:
            m = read_manifest(art)
            what = f"{m.schema_name} table" if m.kind == "table" else "checkpoint"
            size = str(m.rows) if m.kind == "table" else f"{len(m.files)} files"
            t.add_row(str(art.relative_to(run_dir)), what, size, m.stage, m.content_hash[:12])
        console.print(t)
    summary = run_summary(run_dir, metrics)
    shown = summary.select(pl.exclude("artifacts"), "artifacts")  # the wide text column last
    t = Table(title=f"{run_dir}: {summary.height} iteration(s) ('!': artifact without manifest)",
              title_justify="left")
    for c in shown.columns:
        t.add_column(_HEADERS.get(c, c), justify="left" if c == "artifacts" else "right", overflow="fold")
    for r in shown.iter_rows():
        t.add_row(*(_fmt(v) for v in r))
    console.print(t)
    return summary


_HEADERS = {"iteration": "iter", "wall_s": "wall s", "response_len_mean": "resp len",
            "truncated": "trunc", "reward_mean": "reward", "reward_std": "rew std"}


def inspect_path(path: Path, console: Console, *, sample_rows: int = 3, metrics: Sequence[str] = ()) -> None:
    """Summarise whatever is at `path`: a table artifact, a checkpoint or a run directory."""
    path = Path(path)
    kind = kind_of(path)
    if kind == "run":
        show_run(path, console, metrics)
    elif kind == "checkpoint":
        show_checkpoint(path, console)
    else:
        show_table_artifact(path, console, sample_rows)
