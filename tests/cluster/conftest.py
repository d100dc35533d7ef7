"""A 2-iteration tiny run in one process, the reference every launcher's run must reproduce."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import MINI

#: MINI with rollouts in 2 shards, a reference model (so the reference stage runs), micro-batches of 8 (so 2 ranks each
#: get one of the 16 rows' minibatch), and a format reward that varies within groups (MINI's
#: exact-match reward is 0 everywhere after 5 SFT steps, and zero advantages would leave the
#: policy where it started: a policy comparison that could not fail).
LAUNCHED = {
    **MINI,
    "eval_every": 0,
    "rollout": {**MINI["rollout"], "groups_per_shard": 2},  # 2 shards: each of 2 workers writes one
    "model": {"reference": True},
    "optimize": {**MINI["optimize"], "micro_batch_size": 8},
    "score": {"components": [*MINI["score"]["components"],
                             {"name": "alnum", "type": "regex_format", "pattern": "[0-9A-Za-z]"}]},
}

#: Rollout and reference on 2 worker processes each, optimize on 2 torchrun ranks.
PLACEMENT = {"rollout": {"workers": 2}, "reference": {"workers": 2},
             "optimize": {"nodes": 1, "ranks_per_node": 2}}

DETERMINISTIC = ("rollouts", "scores", "reference", "advantages")


def write_preset(path: Path, launch: dict | None = None) -> Path:
    path.write_text(yaml.safe_dump({**LAUNCHED, **({"launch": launch} if launch else {})}))
    return path


def _content_hashes(run_dir: Path, iteration: str) -> dict[str, str]:
    return {name: json.loads((run_dir / iteration / name / "_manifest.json").read_text())["content_hash"]
            for name in DETERMINISTIC}


def _max_difference(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    pa, pb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert pa.keys() == pb.keys()
    return max((pa[k] - pb[k]).abs().max().item() for k in pa)


@pytest.fixture(scope="session")
def launched_preset():
    """`launched_preset(path, launch=None)`: write the LAUNCHED preset (with a launch section)."""
    return write_preset


@pytest.fixture(scope="session")
def assert_like_in_process(in_process_run):
    """`assert_like_in_process(run_dir)`: the first iteration's rollouts, scores, reference and
    advantages have the in-process run's content hashes, and both iterations' policies are within
    1e-5 of its policies (and moved: the comparison can fail)."""

    def check(run_dir: Path) -> None:
        assert _content_hashes(run_dir, "iter_0000") == _content_hashes(in_process_run, "iter_0000")
        start = in_process_run / "models" / "sft"
        for k in ("iter_0000", "iter_0001"):
            # 2 ranks sum the same per-token gradients in another order (gloo all-reduce), so
            # parameters differ by float32 rounding after Adam steps of lr 1e-3: ~1e-7, bound 1e-5
            # (the rank-invariance test in tests/stages/optimize uses the same bound).
            assert _max_difference(run_dir / k / "policy", in_process_run / k / "policy") <= 1e-5, k
            assert _max_difference(in_process_run / k / "policy", start) > 1e-4, f"{k}: the policy did not move"

    return check


@pytest.fixture(scope="session")
def in_process_run(tmp_path_factory) -> Path:
    """runs/mini of the LAUNCHED preset run in this process (the run name is the same in every
    comparison: it is a column of the artifacts)."""
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.pipelines.runner import Pipeline

    root = tmp_path_factory.mktemp("in_process")
    run_dir = root / "runs" / "mini"
    Pipeline(load_preset(write_preset(root / "mini.yaml")), run_dir, log=lambda s: None).run()
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
