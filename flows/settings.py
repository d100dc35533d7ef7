"""Prefect settings rlpipe applies before Prefect is imported (each only if the user has not set it).

- Analytics off: with it on, the temporary local API can fail with "database is locked".
- A longer start-up timeout for the temporary local API: on a loaded 2-core machine it takes
  15-30 s, more than Prefect's default wait.
- At interpreter exit the temporary API is stopped while its task-run recorder may still be
  writing the last event; Prefect 3.8 then logs "Error flushing N events" with a CancelledError
  traceback, although the run itself completed. We drop exactly those records (a CancelledError
  during that service's shutdown flush); every other error still shows.
"""

from __future__ import annotations

import asyncio
import logging
import os

DEFAULTS = {
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
    logging.getLogger("prefect.server.services.task_run_recorder").addFilter(_DropShutdownFlushErrors())
