"""async.staleness: rollout k samples from the policy optimize k-1-S wrote, a schedule fixed by S.

With S = 1 over 4 iterations, rollout k reads iteration k-2's policy (the start policy for k < 2;
read from the manifests) and records how stale it is; the same preset run in order in one process
and overlapped (optimize on a resident worker of its own, rollout ahead of it in the driver) gives
the same artifacts, bit for bit; a run SIGKILLed mid-way resumes to them; S = 0 is the synchronous
run (tests/pipelines/test_golden.py keeps its hashes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import KEEP_EVERYTHING, MINI

pytestmark = [getattr(pytest.mark, "async"), pytest.mark.slow]  # (`async` is a keyword: -m async selects them)

#: MINI, 4 iterations, S = 1, a format reward so that the groups' rewards vary (the policy moves).
#: Every policy stays: each is read as the sampler of a later rollout (tests/pipelines/test_keep.py
#: prunes an asynchronous run).
ASYNC = {**MINI, "iterations": 4, "eval_every": 2, "async": {"staleness": 1}, "keep": KEEP_EVERYTHING,
         "score": {"components": [*MINI["score"]["components"],
                                  {"name": "alnum", "type": "regex_format", "pattern": "[0-9A-Za-z]"}]}}
#: Optimize on a resident worker of its own: the driver overlaps rollout k with optimize k-1.
OVERLAPPED = {"launcher": "processes", "optimize": {"ranks_per_node": 1}}


def _hashes(run_dir: Path) -> dict[str, str]:
    return {str(m.parent.relative_to(run_dir)): json.loads(m.read_text())["content_hash"]
            for m in sorted(run_dir.glob("iter_*/*/_manifest.json"))}


@pytest.fixture(scope="module")
def in_order(tmp_path_factory) -> Path:
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.pipelines.runner import Pipeline

    root = tmp_path_factory.mktemp("async_in_order")
    (root / "p.yaml").write_text(yaml.safe_dump(ASYNC))
    pipeline = Pipeline(load_preset(root / "p.yaml"), root / "runs" / "mini", log=lambda s: None)
    assert not pipeline.overlaps
    pipeline.run()
    return root / "runs" / "mini"


def test_rollout_k_samples_from_the_policy_of_iteration_k_minus_2(in_order):
    from rlpipe.pipelines.report import run_table
    from rlpipe.schemas import read_manifest, read_table_artifact

    start = read_manifest(in_order / "models" / "sft").content_hash
    for k in range(4):
        rollouts = read_manifest(in_order / f"iter_{k:04d}" / "rollouts")
        sampler = in_order / f"iter_{k - 2:04d}" / "policy" if k >= 2 else in_order / "models" / "sft"
        expected = read_manifest(sampler).content_hash if k >= 2 else start
        assert rollouts.inputs["checkpoint"].content_hash == expected, k
        assert Path(rollouts.inputs["checkpoint"].path).resolve() == sampler.resolve()
        assert rollouts.extra["sampled_by"] == {"policy_version": max(0, k - 1), "staleness": min(k, 1), "chat_template": False}
        rows = read_table_artifact(in_order / f"iter_{k:04d}" / "rollouts").to_pydict()
        assert set(rows["policy_version"]) == {max(0, k - 1)}
        # optimize k still continues from optimize k-1's policy, with truncated importance sampling
        optimize = read_manifest(in_order / f"iter_{k:04d}" / "policy")
        assert optimize.config["tis_cap"] == 2.0
        if k:
            assert Path(optimize.inputs["policy"].path).resolve() == (in_order / f"iter_{k - 1:04d}" / "policy").resolve()
    assert read_manifest(in_order / "iter_0002" / "rollouts").content_hash != \
        read_manifest(in_order / "iter_0001" / "rollouts").content_hash
    assert run_table(in_order)["staleness"].to_list() == [None, 1.0, 1.0, 1.0]


def test_overlapped_equals_in_order_and_a_killed_run_resumes_to_it(in_order, tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text(yaml.safe_dump({**ASYNC, "launch": OVERLAPPED}))
    run_dir = tmp_path / "runs" / "mini"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "rlpipe.pipelines.cli", "run", str(preset), "--local", "--run-dir", str(run_dir)]
    # killed while iteration 2's rollout runs ahead of optimize 1 (or just after)
    killed = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not (run_dir / "iter_0002" / "rollouts" / "_manifest.json").is_file():
        assert killed.poll() is None and time.monotonic() < deadline, killed.communicate()[0]
        time.sleep(0.01)
    killed.send_signal(signal.SIGKILL)
    killed.communicate()
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _hashes(run_dir) == _hashes(in_order) and len(_hashes(run_dir)) > 4 * 5
    # and uninterrupted, overlapped (the driver's lanes), in this process
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.pipelines.runner import Pipeline

    again = tmp_path / "again" / "mini"
    pipeline = Pipeline(load_preset(preset), again, log=lambda s: None)
    assert pipeline.overlaps
    pipeline.run()
    assert _hashes(again) == _hashes(in_order)
