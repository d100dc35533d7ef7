"""The in-process run of the LAUNCHED preset (tests/launched.py), the reference every launcher's run must
reproduce, and a real one-node Slurm cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
from launched import assert_like_reference, write_preset


@pytest.fixture(scope="session")
def launched_preset():
    """`launched_preset(path, launch=None)`: write the LAUNCHED preset (with a launch section)."""
    return write_preset


@pytest.fixture(scope="session")
def assert_like_in_process(in_process_run):
    """`assert_like_in_process(run_dir)`: `assert_like_reference` against the in-process run."""
    return lambda run_dir: assert_like_reference(run_dir, in_process_run)


@pytest.fixture(scope="session")
def in_process_run(tmp_path_factory) -> Path:
    """runs/mini of the LAUNCHED preset run in this process, 3 iterations (the run name is the
    same in every comparison: it is a column of the artifacts)."""
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.pipelines.runner import Pipeline

    root = tmp_path_factory.mktemp("in_process")
    run_dir = root / "runs" / "mini"
    Pipeline(load_preset(write_preset(root / "mini.yaml"), ["iterations=3"]), run_dir, log=lambda s: None).run()
    return run_dir


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real one-node Slurm cluster for the session (`rlpipe.cluster.slurm_local`, as `make
    slurm-up`): installs slurm-wlm and munge when missing; skips where that cannot be done (not
    root, no apt-get). Yields the environment for sbatch / srun (SLURM_CONF)."""
    import shutil
    import tempfile

    from rlpipe.cluster import slurm_local

    state = Path(tempfile.mkdtemp(prefix="rlpipe-slurm-"))  # tmp_path is 0700: munged refuses it
    try:
        env = slurm_local.up(state)
    except slurm_local.SlurmUnavailable as e:
        shutil.rmtree(state, ignore_errors=True)
        pytest.skip(str(e))
    try:
        yield env
    finally:
        slurm_local.down(state)
        shutil.rmtree(state, ignore_errors=True)
