"""Metric sinks: the run's summary, sent to experiment trackers as it is made.

A preset names its sinks (`loggers: [tensorboard, mlflow, wandb]`); each gets, through the real
library, the resolved preset as hyper-parameters and, after every iteration, the summary row of
`report.iteration_row` (same names, same numbers as the report and `rlpipe inspect`; stage times
included) at step n = `report.shown_iteration(k)`, with a table of sample completions (prompt,
response, reward, answer, finish reason). They write under runs/<run>/logs/<sink>/:

- tensorboard: event files (torch.utils.tensorboard): scalars, the preset as hparams and as
  text, the samples as a markdown text per step. `tensorboard --logdir runs/<run>/logs/tensorboard`.
- mlflow: a run in experiment `rlpipe` (or $MLFLOW_EXPERIMENT_NAME) of the tracking store
  $MLFLOW_TRACKING_URI, by default a SQLite store in the run directory (MLflow 3 refuses new
  file stores): `mlflow ui --backend-store-uri sqlite:///runs/<run>/logs/mlflow/mlflow.db`.
  Metrics per step, the preset as params, the samples as tables samples/iteration_NNNN.json.
- wandb: a W&B run, offline unless $WANDB_MODE says otherwise (no network needed;
  `wandb sync runs/<run>/logs/wandb/wandb/offline-run-*` uploads it later); the samples as a
  wandb.Table per step.

`RunMonitor` is what the pipeline calls: it opens the sinks, and after every iteration logs to
them and rewrites the report (report/index.html is the page to watch).

A sink is a class with `log_hparams(dict)`, `log_iteration(step, metrics, samples)` and
`close()`, constructed with (log directory, run name), registered in SINKS by name.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlpipe.pipelines.report_html import REFRESH_SECONDS
from rlpipe.schemas.config_files import ConfigError

_log = logging.getLogger(__name__)

#: The live report's curves.png takes at most 1/PLOT_SHARE of a run's time (RunMonitor): 1%.
PLOT_SHARE = 100


def report_due(now: float, last: float | None, *, interval: float, cost: float = 0.0, share: float = 1.0) -> bool:
    """Whether the live report (or its plot) is written again at `now`: the first time (`last`
    None), then once `interval` seconds have passed since `last` and at most 1/`share` of the time
    goes to it (`cost` seconds each). The page reloads every REFRESH_SECONDS: a report written
    more often is one no reader sees (a 1M-parameter iteration takes 0.3 s, its report 0.02-0.03 s:
    8% of it)."""
    return last is None or now - last >= max(interval, share * cost)


class Sink:
    """Where per-iteration metrics go. Subclasses open their library in __init__."""

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        """The resolved preset, flattened to dotted keys (`optimize.lr`) with scalar values."""
        raise NotImplementedError

    def log_iteration(self, step: int, metrics: dict[str, float], samples) -> None:
        """The summary row of shown iteration `step`, and a Polars frame of sample completions."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class TensorBoardSink(Sink):
    def __init__(self, log_dir: Path, run: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        import yaml
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        # Written into this run's own event file (SummaryWriter.add_hparams would open a sub-run).
        for summary in hparams_summary(hparams, {}):
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("preset", "```\n" + yaml.safe_dump(hparams, sort_keys=False) + "```")

    def log_iteration(self, step: int, metrics: dict[str, float], samples) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.add_text("samples", samples_markdown(samples), step)
        self.writer.flush()  # watchable now, not at the next 2-minute flush

    def close(self) -> None:
        self.writer.close()


class MLflowSink(Sink):
    def __init__(self, log_dir: Path, run: str):
        from mlflow import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if not uri:
            log_dir.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{log_dir.resolve() / 'mlflow.db'}"
            artifacts = (log_dir.resolve() / "artifacts").as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "rlpipe")
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found else self.client.create_experiment(name, artifact_location=artifacts)
        self.run_id = self.client.create_run(experiment, run_name=run).info.run_id

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        from mlflow.entities import Param

        # MLflow keeps at most 6000 characters per param value.
        params = [Param(k, str(v)[:6000]) for k, v in hparams.items()]
        for i in range(0, len(params), 100):  # log_batch takes at most 100 params per call
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log_iteration(self, step: int, metrics: dict[str, float], samples) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])
        self.client.log_table(self.run_id, data=samples.to_pandas(), artifact_file=f"samples/iteration_{step:04d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbSink(Sink):
    def __init__(self, log_dir: Path, run: str):
        import wandb

        log_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "rlpipe"), name=run, dir=str(log_dir),
                              mode=os.environ.get("WANDB_MODE", "offline"), reinit="create_new",
                              settings=wandb.Settings(console="off", silent=True, disable_git=True))

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        self.run.config.update(hparams)

    def log_iteration(self, step: int, metrics: dict[str, float], samples) -> None:
        import wandb

        table = wandb.Table(columns=samples.columns, data=[list(r) for r in samples.iter_rows()])
        self.run.log({**metrics, "samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


#: Sink name (as a preset's `loggers` names it) -> class.
SINKS: dict[str, Callable[[Path, str], Sink]] = {
    "tensorboard": TensorBoardSink,
    "mlflow": MLflowSink,
    "wandb": WandbSink,
}


def check_sink_names(names: Sequence[str]) -> None:
    """ValueError naming the unknown sinks and the known ones."""
    unknown = [n for n in names if n not in SINKS]
    if unknown:
        raise ValueError(f"unknown logger(s) {unknown}; known: {', '.join(SINKS)}")


def open_sinks(names: Sequence[str], logs_dir: Path, run: str) -> list[Sink]:
    """The named sinks, each writing under logs_dir/<name>/."""
    try:
        check_sink_names(names)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return [SINKS[n](Path(logs_dir) / n, run) for n in names]


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'optimize': {'lr': 1e-3}} -> {'optimize.lr': 1e-3}; lists as their string, None as 'null'."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{key}."))
        elif isinstance(v, bool | int | float | str):
            out[key] = v
        else:
            out[key] = "null" if v is None else str(v)
    return out


def samples_markdown(samples) -> str:
    """Sample completions as a markdown table (for TensorBoard's text plugin)."""
    from rlpipe.pipelines.display import format_value, printable

    def cell(v: Any) -> str:
        return printable(format_value(v)).replace("|", "\\|")

    head = "| " + " | ".join(samples.columns) + " |"
    sep = "|" + "---|" * len(samples.columns)
    return "\n".join([head, sep, *("| " + " | ".join(cell(v) for v in r) + " |" for r in samples.iter_rows())])


class RunMonitor:
    """Watches a run for the pipeline: after every iteration it logs the summary row and sample
    completions to the preset's sinks and rewrites the report (live); `close()` closes the sinks
    and writes the final report. Sinks open at the first iteration (nothing opens for a run that
    fails in its set-up). `enabled=False` (a read-only run directory): neither. Also a context
    manager (closes on exit, an error included)."""

    def __init__(self, preset: Any, run_dir: Path | str, *, enabled: bool = True):
        self.preset, self.enabled = preset, enabled
        self.run_dir = Path(run_dir)
        self.loggers = list(getattr(preset, "loggers", []) or [])
        check_sink_names(self.loggers)
        self.sinks: list[Sink] | None = None
        self._written_at: float | None = None  # perf_counter of the live report's last write
        self._plotted_at: float | None = None  # and of its last curves.png
        self._plot_s = 0.0  # what that plot cost
        self._live: threading.Thread | None = None  # the live report being rendered, if one is

    def _open(self) -> list[Sink]:
        if self.sinks is None:
            self.sinks = open_sinks(self.loggers, self.run_dir / "logs", self.run_dir.name)
            hparams = flatten(self.preset.model_dump(mode="json"))
            for sink in self.sinks:
                sink.log_hparams(hparams)
        return self.sinks

    def on_iteration(self, record: Any) -> None:
        """After iteration `record.iteration` (an IterationRecord, or anything with .iteration)."""
        from rlpipe.pipelines.report import iteration_row, report_inputs, sample_completions

        if not self.enabled:
            return
        sinks = self._open()
        if sinks:
            k = record.iteration
            row = iteration_row(self.run_dir, k)
            step = int(row.pop("iteration"))
            samples = sample_completions(self.run_dir, k)
            for sink in sinks:
                sink.log_iteration(step, row, samples)
        # The report is rewritten when the page's next reload can show it (REFRESH_SECONDS since
        # the last write), its curves.png (a matplotlib render, 0.1-2 s on a CPU: more than a tiny
        # iteration) also at most 1/PLOT_SHARE of the run; `close` writes the final one. What it
        # shows is read here (milliseconds: each iteration's row is cached), and rendered and
        # written by a thread while the next iteration runs: off the critical path.
        now = time.perf_counter()
        if (self._live is not None and self._live.is_alive()) or not report_due(
                now, self._written_at, interval=REFRESH_SECONDS):
            return
        plot = report_due(now, self._plotted_at, interval=REFRESH_SECONDS, cost=self._plot_s, share=PLOT_SHARE)
        self._written_at = now
        self._live = threading.Thread(target=self._render_live, args=(report_inputs(self.run_dir), plot),
                                      name="rlpipe-live-report", daemon=True)
        self._live.start()

    def _render_live(self, inputs: Any, plot: bool) -> None:
        from rlpipe.pipelines.report import render_report

        started = time.perf_counter()
        try:
            render_report(inputs, live=True, plot=plot)
        except Exception as e:  # noqa: BLE001 (a report is no reason to stop training; the final one is written again)
            _log.warning(f"the live report could not be written ({type(e).__name__}: {e})")
            return
        if plot:
            self._plotted_at, self._plot_s = started, time.perf_counter() - started

    def wait_live(self) -> None:
        """Until the live report being rendered (if one is) is written."""
        if self._live is not None:
            self._live.join()

    def close(self) -> None:
        from rlpipe.pipelines.report import write_report

        self.wait_live()
        for sink in self.sinks or []:
            sink.close()
        self.sinks = None
        if self.enabled:
            write_report(self.run_dir, live=False)

    def __enter__(self) -> RunMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
