"""Prefect settings rlpipe applies before Prefect is imported (each only if the user has not set it).

- Analytics off: with it on, the temporary local API can fail with "database is locked".
- A longer start-up timeout for the temporary local API: on a loaded 2-core machine it takes
  15-30 s, more than Prefect's default wait.
- At interpreter exit the temporary API is stopped while its task-run recorder may still be
  writing the last event; Prefect 3.8 then logs "Error flushing N events" with a CancelledError
  traceback, although the run itself completed. We drop exactly those records (a CancelledError
  during that service's shutdown flush); every other error still shows.
- rlpipe's loggers in Prefect's UI: `rlpipe` is added to Prefect's extra loggers, so every
  `rlpipe.*` record made inside a flow or task run is sent to the API with the run's logs (records
  made outside a run, e.g. by a background writer thread, are not sent, and Prefect says nothing
  about them). The `rlpipe` logger's level is RLPIPE_LOG_LEVEL (INFO) unless a command set it.
"""

from __future__ import annotations

import asyncio
import logging
import os

from rlpipe.stages.common.log import LEVEL_ENV, ROOT, parse_level

DEFAULTS = {
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_UI_ENABLED": "false",
}


class _DropShutdownFlushErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        shutdown_cancel = isinstance(exc, asyncio.CancelledError) or (
            exc is not None and isinstance(exc.__context__, asyncio.CancelledError)
        )
        return not (record.getMessage().startswith("Error flushing") and shutdown_cancel)


def configure() -> None:
    """Apply rlpipe's Prefect defaults; call before the first `import prefect`."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
    extra = [name.strip() for name in os.environ.get("PREFECT_LOGGING_EXTRA_LOGGERS", "").split(",") if name.strip()]
    if ROOT not in extra:
        os.environ["PREFECT_LOGGING_EXTRA_LOGGERS"] = ",".join([*extra, ROOT])
    show_rlpipe_records()


def show_rlpipe_records() -> None:
    """The `rlpipe` logger at RLPIPE_LOG_LEVEL (INFO) unless a command line set its level: in a
    Prefect worker's process nothing else does, and below WARNING it would send nothing to the
    API. Called again at each flow's start (an embedding application may have reset it since)."""
    rlpipe_logger = logging.getLogger(ROOT)
    if rlpipe_logger.level == logging.NOTSET:
        rlpipe_logger.setLevel(parse_level(os.environ.get(LEVEL_ENV) or "INFO"))
    logging.getLogger("prefect.server.services.task_run_recorder").addFilter(_DropShutdownFlushErrors())
