"""Diagnostics through stdlib logging (stages/common/log.py): a handler on the `rlpipe` logger gets
a stage's records; --log-level and RLPIPE_LOG_LEVEL set what shows; rank 0 only under torchrun;
plain lines off a terminal, as the log files had them."""

from __future__ import annotations

import logging

import pytest
from typer.testing import CliRunner

from rlpipe.pipelines.cli import app
from rlpipe.schemas import read_manifest
from rlpipe.stages.common.cli import stage_main
from rlpipe.stages.common.log import configure_logging


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def _task(tmp_path, *extra):
    return stage_main("task", [f"train={tmp_path / 'train'}", f"heldout={tmp_path / 'heldout'}", "n_train=8",
                               "n_heldout=4", *extra])


def test_a_handler_on_the_rlpipe_logger_receives_a_stages_records(tmp_path, capsys):
    records = Records()
    logging.getLogger("rlpipe").addHandler(records)
    try:
        assert _task(tmp_path) == 0
    finally:
        logging.getLogger("rlpipe").removeHandler(records)
    content = read_manifest(tmp_path / "train").content_hash[:12]
    [closing] = [r for r in records.records if r.name == "rlpipe.stages.common.cli"]
    assert closing.levelno == logging.INFO
    assert closing.getMessage() == (f"task: wrote {tmp_path / 'train'}, {tmp_path / 'heldout'} "
                                    f"(8 rows in 1 shard(s), content {content}) in "
                                    f"{closing.getMessage().rsplit(' in ', 1)[1]}")
    # off a terminal, the line is the message alone, on stderr (stdout is the command's output)
    out, err = capsys.readouterr()
    assert closing.getMessage() + "\n" in err and "wrote" not in out


def test_log_level_warning_silences_info_lines(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RLPIPE_LOG_LEVEL", raising=False)
    assert _task(tmp_path, "--log-level", "WARNING") == 0
    assert "wrote" not in capsys.readouterr().err
    # the level chosen is what the processes a run launches inherit
    import os

    assert os.environ["RLPIPE_LOG_LEVEL"] == "WARNING"
    # the environment variable alone does the same; a warning still shows, prefixed as errors are
    monkeypatch.setenv("RLPIPE_LOG_LEVEL", "warning")
    assert _task(tmp_path / "again") == 0
    logging.getLogger("rlpipe.test").warning("disk nearly full")
    err = capsys.readouterr().err
    assert "wrote" not in err and "warning: disk nearly full\n" in err


def test_a_bad_level_is_one_error_line_and_exit_2(tmp_path, capsys):
    assert _task(tmp_path, "--log-level", "LOUD") == 2
    assert capsys.readouterr().err == "error: --log-level: log level 'LOUD': use one of DEBUG, INFO, WARNING, ERROR\n"
    r = CliRunner().invoke(app, ["--log-level", "LOUD", "schema"])
    assert r.exit_code == 2 and "log level 'LOUD': use one of DEBUG, INFO, WARNING, ERROR" in r.output


@pytest.mark.parametrize(("rank", "ranks", "shown"), [("0", None, True), ("1", None, False), ("1", "all", True)])
def test_info_on_rank_0_only_under_torchrun(rank, ranks, shown, monkeypatch, capsys):
    monkeypatch.setenv("RANK", rank)
    if ranks is None:
        monkeypatch.delenv("RLPIPE_LOG_RANKS", raising=False)
    else:
        monkeypatch.setenv("RLPIPE_LOG_RANKS", ranks)
    configure_logging("INFO")
    logging.getLogger("rlpipe.stages.sft.run").info("sft: 3 steps")
    logging.getLogger("rlpipe.stages.sft.run").error("sft: lost")
    err = capsys.readouterr().err
    assert ("sft: 3 steps\n" in err) == shown and "error: sft: lost\n" in err


def test_the_rlpipe_command_takes_log_level_for_the_stage_it_runs(tmp_path):
    args = ["stage", "task", f"train={tmp_path / 'train'}", f"heldout={tmp_path / 'heldout'}", "n_train=8", "n_heldout=4"]
    loud = CliRunner().invoke(app, args)
    assert loud.exit_code == 0 and f"task: wrote {tmp_path / 'train'}" in loud.output
    quiet = CliRunner().invoke(app, ["--log-level", "WARNING", *args, "--force"])
    assert quiet.exit_code == 0 and "wrote" not in quiet.output, quiet.output
