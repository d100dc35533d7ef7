"""What the `rlpipe` commands print: results on stdout, one `error:` paragraph on stderr."""

from __future__ import annotations

import typer


def console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def fail(message: str, code: int) -> typer.Exit:
    from rich.text import Text

    console(stderr=True).print(Text.assemble(("error: ", "bold red"), message))
    return typer.Exit(code)


def failed(e: Exception, debug: bool) -> typer.Exit:
    """The exit of a command that failed with `e` (stages.common.cli.report_failure: a user or
    machine problem in one `error:` paragraph, a bug with its traceback)."""
    from rlpipe.stages.common.cli import report_failure

    return typer.Exit(report_failure(e, debug, lambda message: fail(message, 0)))
