"""rlpipe's diagnostics through the standard `logging` module, under the `rlpipe.*` logger names.

Every module logs to `logging.getLogger(__name__)` (`rlpipe.stages.sft.run`, `rlpipe.cluster.worker`,
...), so a handler a user, Slurm wrapper or Prefect attaches to the `rlpipe` logger receives every
stage's records. What a command prints as its result (a table, `wrote ...`, `error: ...`) stays on
stdout and stderr; the progress lines of long loops stay as they are (stages/common/progress.py).

The entry points (`rlpipe`, `python -m rlpipe.stages.<name>`, a resident worker, the Prefect flows)
call `configure_logging`, which puts one handler on the `rlpipe` logger:

- its level: `--log-level` where the command has it, else `RLPIPE_LOG_LEVEL`, else INFO; the level
  chosen is put in the environment, so the processes a run launches (workers, torchrun ranks)
  log at the same level;
- rank 0 only under torchrun: a process whose `RANK` is not 0 shows warnings and errors only, as
  its info lines would repeat rank 0's N times (`RLPIPE_LOG_RANKS=all` shows every rank's);
- on a terminal, rich's rendering (time, level); elsewhere (a log file, a pipe, Slurm's output)
  plain lines: an info record is its message alone, others `warning: <message>`, so the log files
  read as before;
- the stream is looked up at each record (sys.stderr at that moment), so output redirected later
  (a worker's order log, a test's capture) gets the records.

Library use (importing rlpipe and calling a stage from Python) configures nothing: records go
wherever the application's logging sends them.
"""

from __future__ import annotations

import logging
import os
import sys

#: The root of rlpipe's loggers.
ROOT = "rlpipe"
#: The level when no --log-level is given (DEBUG, INFO, WARNING, ERROR).
LEVEL_ENV = "RLPIPE_LOG_LEVEL"
#: "all": every torchrun rank logs at the chosen level (default: rank 0 only; others warn).
RANKS_ENV = "RLPIPE_LOG_RANKS"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class _PlainFormatter(logging.Formatter):
    """An info record as its message alone (the lines a log file had before logging); others
    prefixed with their level in lower case, as `error:` lines are."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text if record.levelno == logging.INFO else f"{record.levelname.lower()}: {text}"


class _StderrHandler(logging.StreamHandler):
    """A stream handler writing to whatever sys.stderr is when a record comes."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # (StreamHandler.__init__ sets it)
        pass


def parse_level(value: str) -> int:
    """A level name (any case) as logging's number; ValueError naming the choices."""
    name = value.strip().upper()
    if name not in LEVELS:
        raise ValueError(f"log level {value!r}: use one of {', '.join(LEVELS)}")
    return getattr(logging, name)


def configure_logging(level: str | None = None, *, all_ranks: bool = False) -> logging.Logger:
    """Set up the `rlpipe` logger for a command-line process (see the module's doc); idempotent.
    `level`: --log-level's value (None: RLPIPE_LOG_LEVEL, else INFO). `all_ranks`: a process whose
    RANK is not 0 logs at that level too (a resident worker: each member, a rank of one job
    included, writes its orders' output to a log of its own)."""
    name = (level or os.environ.get(LEVEL_ENV) or "INFO").upper()
    number = parse_level(name)
    os.environ[LEVEL_ENV] = name  # (inherited by what this process launches)
    every_rank = all_ranks or os.environ.get(RANKS_ENV, "").lower() == "all"
    if os.environ.get("RANK", "0") != "0" and not every_rank:
        number = max(number, logging.WARNING)
    logger = logging.getLogger(ROOT)
    for old in [h for h in logger.handlers if getattr(h, "_rlpipe", False)]:
        logger.removeHandler(old)
    handler: logging.Handler
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.logging import RichHandler

        handler = RichHandler(console=Console(stderr=True), show_path=False, markup=False, rich_tracebacks=False)
    else:
        handler = _StderrHandler()
        handler.setFormatter(_PlainFormatter())
    handler._rlpipe = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(number)
    # A command owns its process: records stop here rather than reaching a root handler a library
    # may have set up as well (each line shown twice). Handlers on `rlpipe` itself still get them.
    logger.propagate = False
    return logger
