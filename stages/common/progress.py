"""The progress display of every stage: `with progress("sft", total) as advance: ... advance(loss=x)`.

On a terminal: a rich bar on stderr (step/total, elapsed, ETA and the latest stats). Off a
terminal (Slurm / nohup logs, a file): a plain line whenever `interval_s` seconds have passed or
another 10% of the steps is done, and one at the end, e.g.
    sft: 30/100 (30%) 2.41 it/s, elapsed 12s, ETA 29s, loss=0.8123
Only rank 0 shows anything (other ranks would repeat the same lines).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO


def _is_rank_zero() -> bool:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except ImportError:
        pass
    return os.environ.get("RANK", "0") == "0"


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _stats_text(stats: dict[str, object]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items())


class LineProgress:
    """Plain progress lines for a stream that is not a terminal."""

    def __init__(self, label: str, total: int, stream: IO[str], interval_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.label, self.total, self.stream, self.interval_s, self.clock = label, total, stream, interval_s, clock
        self.done = 0
        self.stats: dict[str, object] = {}
        self.started = self.last_time = clock()
        self.last_decile = 0
        self.written: int | None = None  # the count shown by the last line

    def advance(self, n: int = 1, **stats: object) -> None:
        self.done += n
        self.stats.update(stats)
        now = self.clock()
        decile = 10 * self.done // self.total if self.total > 0 else 0
        if decile > self.last_decile or now - self.last_time >= self.interval_s:
            self.write(now)

    def write(self, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        elapsed = now - self.started
        rate = self.done / elapsed if elapsed > 0 else float("nan")
        line = f"{self.label}: {self.done}/{self.total}"
        if self.total > 0:
            line += f" ({100 * self.done // self.total}%)"
        line += f" {rate:.0f}" if rate >= 100 else f" {rate:.3g}"
        line += f" it/s, elapsed {_duration(elapsed)}"
        if self.done < self.total:
            eta = (self.total - self.done) / rate if rate > 0 else float("nan")
            line += f", ETA {_duration(eta)}"
        if self.stats:
            line += ", " + _stats_text(self.stats)
        print(line, file=self.stream, flush=True)
        self.last_time, self.written = now, self.done
        self.last_decile = 10 * self.done // self.total if self.total > 0 else 0

    def close(self) -> None:
        """The final line (unless the last line already showed the final count)."""
        if self.written != self.done:
            self.write()


@contextmanager
def progress(label: str, total: int, *, enabled: bool | None = None, stream: IO[str] | None = None,
             interval_s: float = 5.0) -> Iterator[Callable[..., None]]:
    """Show progress over `total` steps; yields `advance(n=1, **stats)`.

    Args:
        label: what is counted, first on the line ("sft", "rollout (vllm) worker 0/2").
        enabled: show anything at all; default: on rank 0 only.
        stream: where to write; default sys.stderr. A rich bar if it is a terminal, else lines.
        interval_s: off a terminal, the longest gap between lines (also one per 10% done).
    """
    stream = sys.stderr if stream is None else stream
    if enabled is None:
        enabled = _is_rank_zero()
    if not enabled:
        yield lambda n=1, **stats: None
        return
    if not stream.isatty():
        lines = LineProgress(label, total, stream, interval_s)
        yield lines.advance
        lines.close()
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[stats]}"))
    with Progress(*columns, console=Console(file=stream), transient=False) as bar:
        task = bar.add_task(label, total=total, stats="")

        def advance(n: int = 1, **stats: object) -> None:
            bar.update(task, advance=n, **({"stats": _stats_text(stats)} if stats else {}))

        yield advance
