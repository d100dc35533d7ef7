"""The reliability catalogue shares one uninterrupted run of the miniature preset (the reference
every kill point is compared with, and the source of the inputs the malformed cases corrupt)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, mini_preset_session_file):
    """runs/mini of an uninterrupted run (in this process); treat as read-only."""
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.pipelines.runner import Pipeline

    run_dir = tmp_path_factory.mktemp("reference") / "mini"  # the run name is recorded in the rows
    Pipeline(load_preset(mini_preset_session_file), run_dir, log=lambda s: None).run()
    return run_dir
