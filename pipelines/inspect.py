"""`rlpipe inspect`: readable summaries of a table artifact, a checkpoint or a whole run.

The numbers come from plain functions (`table_stats`, `run_summary`) that return dicts and Polars
frames, so tests check values; `inspect_path` renders them with rich. Everything is read with
Polars through `rlpipe.schemas` (schemas checked), only the columns a statistic needs. A run's
per-iteration numbers are the summary of `pipelines.report` (same names, numbering and
aggregation as the report, the console line and the metric sinks).
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
from rich.markup import escape
from rich.table import Table

from rlpipe.pipelines.display import COLUMNS, format_value, printable
from rlpipe.pipelines.report import (
    iteration_metrics,
    sample_completions,
    shown_iteration,
    stage_seconds,
    step_metrics,
)
from rlpipe.schemas import (
    MANIFEST_NAME,
    ArtifactError,
    ArtifactNotFound,
    Manifest,
    exists,
    read_manifest,
    scan_artifact,
)
from rlpipe.schemas.pruning import PRUNED_NAME
from rlpipe.schemas.runs import iteration_dirs, iteration_index

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
    text = printable(str(value))
    return text if len(text) <= MAX_CELL else f"{text[:MAX_CELL]}... ({len(text)} chars)"


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
    if m.not_written:
        t.add_row("not written", f"{', '.join(m.not_written)} (held in memory only: optimize.policy_weights: "
                                 "with_train_state; listed with their hashes)")
    t.add_row("stage", m.stage)
    t.add_row("wall time", f"{m.wall_time_s:.2f} s")
    t.add_row("content hash", m.content_hash[:12])
    if m.inputs:
        t.add_row("inputs", ", ".join(f"{k}={v.content_hash[:12]}" for k, v in m.inputs.items()))
    t.add_row("created", f"{m.created_at} on {m.host or '?'} ({m.code_version or '?'})")
    return t


def show_table_artifact(path: Path, console: Console, sample_rows: int = 3, decode: bool = False,
                        tokenizer: Path | None = None) -> dict[str, Any]:
    """Print a table artifact's manifest, statistics and sample rows (with `decode`, their token ids
    as text: `pipelines.decoded`); returns the statistics."""
    m = read_manifest(path)
    console.print(_manifest_table(path, m))
    lf = scan_artifact(path)
    stats = table_stats(lf)
    if stats["stats"]:
        t = Table(title="statistics", title_justify="left")
        for c in ("quantity", "mean", "std", "min", "max"):
            t.add_column(c, justify="left" if c == "quantity" else "right")
        for q, v in stats["stats"].items():
            t.add_row(q, *(format_value(v[s]) for s in ("mean", "std", "min", "max")))
        console.print(t)
    if stats["components"]:
        t = Table(title="reward components (unweighted means)", title_justify="left")
        t.add_column("component")
        t.add_column("mean", justify="right")
        for c, v in stats["components"].items():
            t.add_row(c.removeprefix("reward__"), format_value(v))
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
            t.add_row(*(format_value(v) for v in r))
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
        if decode:
            from rlpipe.pipelines.decoded import show_decoded

            show_decoded(path, m, sample.to_dicts(), console, tokenizer)
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
    info: dict[str, Any] = {} if m.not_written else {"params": safetensors_params(path)}
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
#: Directories of an iteration that are not artifacts: the stage configs the pipeline saves.
NOT_ARTIFACTS = frozenset({"configs"})


def run_summary(run_dir: Path, metrics: Sequence[str] = ()) -> pl.DataFrame:
    """One row per iteration of a run with whatever its artifacts hold.

    Columns (those that can be computed): iteration (shown number, see `report.shown_iteration`),
    artifacts (complete ones; unfinished ones, without a manifest, marked '!'; pruned ones by the
    run's `keep`, marked '-'), wall_s (sum of
    the stage times `report.stage_seconds`), rollouts, groups, then the summary of
    `report.iteration_metrics`, then each metric of `metrics` as `report.step_metrics` gives it.
    """
    run_dir = Path(run_dir)
    rows = []
    for k, d in iteration_dirs(run_dir):
        complete, pruned, incomplete = [], [], []
        for art in sorted(p for p in d.iterdir() if p.is_dir() and p.name not in NOT_ARTIFACTS):
            (complete if (art / MANIFEST_NAME).is_file() else pruned if (art / PRUNED_NAME).is_file()
             else incomplete).append(art.name)
        row: dict[str, Any] = {"iteration": shown_iteration(k),
                               "artifacts": " ".join(complete + [f"{n}-" for n in pruned] + [f"{n}!" for n in incomplete]),
                               "wall_s": sum(stage_seconds(d).values())}
        if exists(d / "rollouts"):
            counts = scan_artifact(d / "rollouts").select(pl.len(), pl.col("group_id").n_unique()).collect()
            row["rollouts"], row["groups"] = counts.row(0)
        row.update(iteration_metrics(run_dir, k))
        if metrics and exists(d / "metrics"):
            logged = step_metrics(d / "metrics")
            row.update({n: logged[n] for n in metrics if n in logged})
        rows.append(row)
    if metrics:
        missing = [n for n in metrics if not any(n in r for r in rows)]
        if missing:
            logged = sorted({n for k, d in iteration_dirs(run_dir) if exists(d / "metrics")
                             for n in step_metrics(d / "metrics")})
            raise ArtifactError(f"metric(s) {missing} not logged in {run_dir}; logged: {logged}")
    seen = {c for r in rows for c in r}
    order = ["iteration", "artifacts", "wall_s", "rollouts", "groups"]
    order += [c for c in COLUMNS if c not in order] + [m for m in metrics if m not in COLUMNS]
    order = [c for c in order if c in seen]  # of the held-out metrics, the table shows accuracy
    types = {"iteration": pl.Int32, "artifacts": pl.String, "rollouts": pl.Int64, "groups": pl.Int64}
    return pl.DataFrame([{c: r.get(c) for c in order} for r in rows],
                        schema={c: types.get(c, pl.Float64) for c in order})


def _other_artifacts(run_dir: Path) -> list[Path]:
    """Artifacts of a run outside its iteration directories (data/, models/, eval_0000/, ...)."""
    found = []
    for mf in sorted(run_dir.rglob(MANIFEST_NAME)):
        rel = mf.parent.relative_to(run_dir)
        if rel.parts and iteration_index(rel.parts[0]) is None:
            found.append(mf.parent)
    return found


def _column_width(header: str, cells: list[str]) -> int:
    """Characters a rich table column takes: its widest line plus padding and a border."""
    return max(len(header), *(len(c) for c in cells)) + 3


def print_wide(console: Console, frame: pl.DataFrame, title: str, headers: dict[str, str],
               key: str = "iteration") -> None:
    """Print a frame as one table, or as several that each fit the console's width, every one
    starting with the `key` column (so each row stays identifiable)."""
    cells = {c: [format_value(v) for v in frame[c].to_list()] for c in frame.columns}
    label = {c: headers.get(c, c) for c in frame.columns}
    width = {c: _column_width(label[c], cells[c]) for c in frame.columns}
    groups: list[list[str]] = [[]]
    used = width[key] + 1
    for c in frame.columns:
        if c == key:
            continue
        if groups[-1] and used + width[c] > console.width:
            groups.append([])
            used = width[key] + 1
        groups[-1].append(c)
        used += width[c]
    for i, group in enumerate(groups):
        part = f" ({i + 1}/{len(groups)})" if len(groups) > 1 else ""
        t = Table(title=title + part, title_justify="left")
        for c in (key, *group):
            t.add_column(label[c], justify="right", no_wrap=True)
        for r in range(frame.height):
            t.add_row(*(cells[c][r] for c in (key, *group)))
        console.print(t)


#: Short column headers of the run table (the summary's labels, and inspect's own columns).
_HEADERS = {**{c: label for c, (label, _) in COLUMNS.items()}, "wall_s": "wall s"}


def show_run(run_dir: Path, console: Console, metrics: Sequence[str] = ()) -> pl.DataFrame:
    """Print a run: its artifacts outside the iterations, one row per iteration (split into
    tables that fit the console), then each iteration's artifacts."""
    others = _other_artifacts(run_dir)
    if others:
        t = Table(title=f"{run_dir}: artifacts", title_justify="left")
        t.add_column("artifact", no_wrap=True)
        for c in ("kind", "size", "stage", "content"):
            t.add_column(c, overflow="fold")
        for art in others:
            m = read_manifest(art)
            what = m.schema_name if m.kind == "table" else "checkpoint"
            size = f"{m.rows} rows" if m.kind == "table" else f"{len(m.files)} files"
            t.add_row(str(art.relative_to(run_dir)), what, size, m.stage, m.content_hash[:12])
        console.print(t)
    summary = run_summary(run_dir, metrics)
    console.print(f"{summary.height} iteration(s), n = iter_{{n-1:04d}}; optimiser metrics: means over steps",
                  markup=False)
    print_wide(console, summary.drop("artifacts"), f"{run_dir}: per iteration", _HEADERS)
    t = Table(title="artifacts per iteration ('!': unfinished, no manifest)", title_justify="left")
    t.add_column("iter", justify="right", no_wrap=True)
    t.add_column("artifacts", overflow="fold")
    for n, arts in summary.select("iteration", "artifacts").iter_rows():
        t.add_row(str(n), arts)
    console.print(t)
    return summary


def show_samples(run_dir: Path, console: Console, count: int, iteration: int | None = None) -> pl.DataFrame:
    """Print `count` sample completions (prompt, response, reward, ...) of shown iteration
    `iteration` (default: the latest with rollouts); returns them."""
    with_rollouts = {shown_iteration(k): k for k, d in iteration_dirs(run_dir) if exists(d / "rollouts")}
    if not with_rollouts:
        raise ArtifactNotFound(f"{run_dir}: no iteration has rollouts yet")
    n = max(with_rollouts) if iteration is None else iteration
    if n not in with_rollouts:
        raise ArtifactNotFound(f"{run_dir}: iteration {n} has no rollouts; iterations with rollouts: "
                               f"{sorted(with_rollouts)} (iteration n is iter_{{n-1:04d}})")
    k = with_rollouts[n]
    samples = sample_completions(run_dir, k, count)
    t = Table(title=f"{run_dir}: iteration {n} (iter_{k:04d}), {samples.height} completion(s)",
              title_justify="left")
    for c in samples.columns:
        numeric = samples[c].dtype.is_numeric()
        t.add_column("finish" if c == "finish_reason" else c, justify="right" if numeric else "left",
                     overflow="fold", no_wrap=numeric)
    episodes = "turns" in samples.columns  # their responses are lines, one per turn (sample_completions)
    for r in samples.iter_rows(named=True):  # (model text is no rich markup: '[x]' stays as written)
        t.add_row(*(format_value(v) if isinstance(v, float) or v is None
                    else escape("\n".join(map(_short, v.split("\n")))) if episodes and c == "response"
                    else escape(_short(v)) for c, v in r.items()))
    console.print(t)
    return samples


def inspect_path(path: Path, console: Console, *, sample_rows: int = 3, metrics: Sequence[str] = (),
                 samples: int = 0, iteration: int | None = None, decode: bool = False,
                 tokenizer: Path | None = None) -> None:
    """Summarise whatever is at `path`: a table artifact, a checkpoint or a run directory; for a
    run with `samples` > 0, print that many sample completions of `iteration` instead; `decode`:
    a table artifact's sample rows' token ids as text too."""
    path = Path(path)
    kind = kind_of(path)
    if kind == "run":
        if samples or iteration is not None:
            show_samples(path, console, samples or 4, iteration)
        else:
            show_run(path, console, metrics)
    elif kind == "checkpoint":
        show_checkpoint(path, console)
    else:
        show_table_artifact(path, console, sample_rows, decode, tokenizer)
