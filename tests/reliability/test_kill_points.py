"""Kill points: `rlpipe run` is SIGKILLed at every stage boundary, mid-SFT, during checkpoint saves,
during evaluations and twice in a row at one point; after each kill the same command resumes it.

One chain of segments covers every point: segment i runs until its kill point, segment i+1 resumes
from what i left, and the last one finishes. After every kill, each complete artifact must equal
the uninterrupted reference run's (by content hash) and nothing partial may be visible; at the end
the whole run must equal the reference, and nothing completed before a kill may have been
recomputed. Boundaries are observed from outside (a manifest appears); points inside a stage pause
one function through tests/reliability/pause_driver.py (test-only) and are killed there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from reliability.helpers import ENV, MANIFEST, created, hashes, partial_artifacts

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

DRIVER = Path(__file__).parent / "pause_driver.py"


@dataclass(frozen=True)
class KillPoint:
    name: str
    after: tuple[str, ...] = ()
    """Kill once these artifacts are complete (relative paths in the run)."""
    pause: str | None = None
    """Or: kill while this function ('module:attr@N') is paused at its N-th call."""
    before: tuple[str, ...] = ()
    """Artifacts that must not be complete yet when the kill lands (it landed where meant)."""


POINTS = [
    KillPoint("boundary task | base_model", after=("data/task/train", "data/task/heldout"), before=("models/base",)),
    KillPoint("base_model checkpoint save (files written, no manifest)",
              pause="rlpipe.stages.base_model.run:commit_directory@1", before=("models/base",)),
    KillPoint("boundary base_model | sft", after=("models/base",), before=("models/sft",)),
    KillPoint("mid-SFT (step 3 of 5)", pause="rlpipe.stages.sft.core:sft_loss@3", before=("models/sft",)),
    KillPoint("mid-SFT again (twice in a row)", pause="rlpipe.stages.sft.core:sft_loss@3", before=("models/sft",)),
    KillPoint("boundary sft | initial evaluation", after=("models/sft",), before=("eval_0000",)),
    KillPoint("during the initial evaluation (rollouts done)", after=("eval_0000/rollouts",), before=("eval_0000",)),
    KillPoint("boundary evaluation | rollout", after=("eval_0000",), before=("iter_0000/rollouts",)),
    KillPoint("boundary rollout | score", after=("iter_0000/rollouts",), before=("iter_0000/scores",)),
    KillPoint("boundary score | advantage", after=("iter_0000/scores",), before=("iter_0000/advantages",)),
    KillPoint("boundary advantage | optimize", after=("iter_0000/advantages",), before=("iter_0000/policy",)),
    KillPoint("policy checkpoint save (files written, no manifest)",
              pause="rlpipe.stages.optimize.run:commit_directory@1", before=("iter_0000/policy",)),
    KillPoint("boundary optimize | evaluate", after=("iter_0000/policy",), before=("iter_0000/eval",)),
    KillPoint("during evaluation of iteration 0 (scores done)", after=("iter_0000/eval/scores",), before=("iter_0000/eval",)),
    KillPoint("boundary iteration 0 | iteration 1", after=("iter_0000/eval",), before=("iter_0001/rollouts",)),
]


def _start(cmd: list[str], pause: str | None, pause_file: Path) -> subprocess.Popen:
    env = dict(ENV)
    if pause:
        env |= {"RLPIPE_TEST_PAUSE": pause, "RLPIPE_TEST_PAUSE_FILE": str(pause_file)}
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                            start_new_session=True)


def _kill_at(proc: subprocess.Popen, run_dir: Path, point: KillPoint, pause_file: Path) -> bool:
    """Poll for the point (5 ms), SIGKILL the process group there; True if it was reached."""
    def reached() -> bool:
        if point.pause:
            return pause_file.exists()
        return all((run_dir / a / MANIFEST).is_file() for a in point.after)

    deadline = time.monotonic() + 300
    while not reached() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    hit = reached()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return hit


def test_every_kill_point_resumes_to_the_uninterrupted_run(reference_run, tmp_path):
    reference = hashes(reference_run)
    run_dir = tmp_path / "killed" / "mini"
    cmd = [sys.executable, str(DRIVER), "run", str(reference_run / "preset.yaml"), "--local",
           "--run-dir", str(run_dir)]
    results: list[tuple[str, str]] = []
    kept: dict[str, str] = {}  # manifests complete at some kill: must never be rewritten
    for i, point in enumerate(POINTS):
        pause_file = tmp_path / f"paused-{i}"
        proc = _start(cmd, point.pause, pause_file)
        if not _kill_at(proc, run_dir, point, pause_file):
            results.append((point.name, f"not reached (exit {proc.returncode}): {proc.stderr.read()[-500:]!r}"))
            continue
        proc.stderr.close()
        now = hashes(run_dir)
        wrong = {k: v for k, v in now.items() if reference.get(k) != v}
        early = [b for b in point.before if b in now]
        partial = partial_artifacts(run_dir)
        problems = [f"differs from the reference: {sorted(wrong)}" if wrong else "",
                    f"killed too late, already complete: {early}" if early else "",
                    f"partial artifacts visible: {partial}" if partial else ""]
        results.append((point.name, "; ".join(p for p in problems if p) or "identical"))
        kept |= {k: v for k, v in created(run_dir).items()}
    final = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    assert final.returncode == 0, final.stderr[-2000:]
    after = created(run_dir)
    rewritten = sorted(k for k, v in kept.items() if after.get(k) != v)

    identical = sum(r == "identical" for _, r in results)
    print(f"\nkill points: {identical} identical / {len(POINTS)} tried")
    for name, r in results:
        print(f"  {name}: {r}")
    assert hashes(run_dir) == reference, "the resumed run differs from the uninterrupted run"
    assert rewritten == [], f"finished artifacts recomputed after a kill: {rewritten}"
    assert not partial_artifacts(run_dir) and not list(run_dir.rglob(".*.staging*"))
    assert identical == len(POINTS), results
