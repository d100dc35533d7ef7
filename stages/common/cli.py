"""The command line of every stage: `python -m rlpipe.stages.<name> [-c FILE] [key=value ...]`.

Parses and validates the config before importing the stage's heavy modules (torch, transformers),
so `--help` and config errors answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from rlpipe.schemas.config_files import ConfigError, describe_fields, load_config
from rlpipe.schemas.staging import discard_open_staging
from rlpipe.stages.common.interrupt import exit_on_signals
from rlpipe.stages.common.log import configure_logging

_log = logging.getLogger(__name__)


def own_cache_dirs() -> None:
    """Point the caches libraries would make in the temporary directory at the user's cache
    instead (~/.cache/rlpipe/, or $XDG_CACHE_HOME/rlpipe/), unless the user set them: building a
    model with transformers makes torch's inductor cache folder (/tmp/torchinductor_<user>), which
    would outlive the run. Launched processes inherit the setting."""
    from pathlib import Path

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlpipe"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "torchinductor"))


def exit_process(code: int | str | None) -> NoReturn:
    """End a command-line process with `code` as sys.exit would, but without the interpreter's
    teardown: Python's exit handlers run (atexit: logging, multiprocessing, ...) after the other
    non-daemon threads end, the output is flushed, then os._exit. In the teardown, torch and
    pyarrow's C++ static destructors now and then abort the process ("terminate called without an
    active exception"; measured: `rlpipe stage rollout` on an empty prompts artifact ended with
    SIGABRT, exit 134 instead of 2, in 4 of 12 runs), which a launcher would read as a crash after
    the stage had finished. Only for the entry points of processes (`__main__`), never in-process."""
    import atexit
    import threading

    if isinstance(code, str):
        print(code, file=sys.stderr)
    status = code if isinstance(code, int) else 0 if code is None else 1
    try:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)


def import_ref(ref: str) -> Any:
    """The object named by 'package.module:attribute' (imported on call)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def import_function(ref: str, what: str = "") -> Any:
    """A user's function by import path; a ValueError naming `what` and `ref` if it is not one.

    Args:
        ref: 'package.module:function'.
        what: the config key that named it, for the message (e.g. 'estimator.function').
    """
    at = f"{what}: " if what else ""
    try:
        fn = import_ref(ref)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{at}cannot import {ref!r}: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise ValueError(f"{at}{ref!r} is a {type(fn).__name__}, not a function")
    return fn


def _strip_local_rank(argv: Sequence[str]) -> list[str]:
    """The deepspeed launcher appends `--local_rank=N` to every rank's argv; it becomes LOCAL_RANK."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg.startswith("--local_rank"):
            value = arg.partition("=")[2] or next(it, "0")
            os.environ.setdefault("LOCAL_RANK", value)
            continue
        out.append(arg)
    return out


def report_failure(e: Exception, debug: bool, say: Callable[[str], None]) -> int:
    """Tell the user about a failed command; returns its exit code (`rlpipe.schemas.errors`:
    EXIT_*). A user mistake or a problem of the machine with what it was given
    (`rlpipe.schemas.errors.user_message`: one paragraph naming the file and what to do, through
    `say`): 2; a lost process (`MachineError`: one paragraph naming the stage, the process and its
    log): 3; their traceback only with `debug`. Anything else is a bug in rlpipe: its traceback
    and a note saying so: 1."""
    import traceback

    from rlpipe.schemas.errors import (
        BUG_NOTE,
        EXIT_BUG,
        EXIT_MACHINE,
        EXIT_USER,
        MachineError,
        user_message,
    )

    message, code = user_message(e), EXIT_USER
    if isinstance(e, MachineError):
        message, code = str(e), EXIT_MACHINE
    if message is not None and not debug:
        say(message)
        return code
    traceback.print_exception(e)
    say(message if message is not None else BUG_NOTE)
    return code if message is not None else EXIT_BUG


def stage_entry(package: str) -> Callable[[Sequence[str] | None], int]:
    """`main(argv)` of the stage package `rlpipe.stages.<name>` (every stage's `__main__.py`)."""
    return functools.partial(stage_main, package.rpartition(".")[2])


def stage_main(name: str, argv: Sequence[str] | None = None) -> int:
    """Parse a stage's command line, run it, print where its artifact went; returns an exit code.

    Args:
        name: a key of the stage registry (`rlpipe.stages.STAGES`).
        argv: the arguments (default: sys.argv[1:]).
    """
    from rlpipe.stages import get_stage

    own_cache_dirs()
    stage = get_stage(name)
    config_cls = stage.config_class()
    argv = _strip_local_rank(sys.argv[1:] if argv is None else argv)
    fields = "\n".join(f"  {k} ({t}, default {d})\n      {doc}" for k, t, d, doc in describe_fields(config_cls))
    parser = argparse.ArgumentParser(
        prog=f"rlpipe stage {name}",
        description=(config_cls.__doc__ or "").strip(),
        epilog=f"config keys (set in the YAML file or as key=value):\n{fields}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-c", "--config", help="YAML file with the stage's config")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (dotted keys)")
    parser.add_argument("--force", action="store_true", help="recompute even if a cached artifact matches")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a user error")
    parser.add_argument("--log-level", metavar="LEVEL", default=None,
                        help="DEBUG, INFO, WARNING or ERROR for rlpipe's diagnostics (default: $RLPIPE_LOG_LEVEL, "
                             "else INFO); the closing line is INFO")
    args = parser.parse_args(argv)
    try:
        configure_logging(args.log_level)
    except ValueError as e:
        print(f"error: --log-level: {e}", file=sys.stderr)
        return 2
    try:
        config = load_config(config_cls, args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        import yaml

        print(yaml.safe_dump(config.resolved(), sort_keys=False), end="")
        return 0
    return run_stage(name, config, force=args.force, debug=args.debug)


def run_stage(name: str, config: Any, *, force: bool = False, debug: bool = False) -> int:
    """Run stage `name` on a parsed config in this process as its command line does (stopped
    cleanly by SIGINT / SIGTERM, a failure reported in one paragraph, nothing partial left,
    where its artifact went printed); returns the exit code."""
    from rlpipe.stages import get_stage
    from rlpipe.stages.common.hub import resolve_hub_inputs

    stage = get_stage(name)
    started = time.perf_counter()
    with exit_on_signals(f"stage {name}"):
        try:
            config = resolve_hub_inputs(config)  # (a checkpoint or data file given as a Hub id: its snapshot)
            manifest = stage.run(config, force=force)
        except Exception as e:
            discard_open_staging()  # nothing partial stays behind
            return report_failure(e, debug, lambda m: print(f"error: {name}: {m}", file=sys.stderr))
    elapsed = time.perf_counter() - started
    where = ", ".join(str(p) for p in config.outputs().values())
    rows = f"{manifest.rows} rows in {len(manifest.shard_names)} shard(s)" if manifest.kind == "table" else f"{len(manifest.files)} files"
    _log.info(f"{name}: wrote {where} ({rows}, content {manifest.content_hash[:12]}) in {elapsed:.1f} s")
    return 0
