"""Kill points: `rlpipe run` is SIGKILLed at every stage boundary, mid-SFT, during checkpoint saves,
during evaluations and twice in a row at one point; after each kill the same command resumes it.

One chain of segments covers every point: segment i runs until its kill point, segment i+1 resumes
from what i left, and the last one finishes. After every kill, each complete artifact must equal
the uninterrupted reference run's (by content hash) and nothing partial may be visible; at the end
the whole run must equal the reference, and nothing completed before a kill may have been
recomputed. Boundaries are observed from outside (a manifest appears); points inside a stage pause
one function through tests/reliability/pause_driver.py (test-only) and are killed there.

Each segment is a process forked from a zygote that has imported rlpipe, torch and DeepSpeed and
run nothing (pause_driver.py): the same fresh run as `rlpipe run` in a new interpreter, without
paying ~8 s of imports sixteen times.
"""

from __future__ import annotations

import json
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
    """Kill once these artifacts are complete (relative paths in the run); with `pause`, they must
    be complete when the pause is reached."""
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
    # Pauses, not polls: scoring and advantages take a few milliseconds at this size, so a poll
    # for the previous manifest can land after the next one. Each pause is the stage's first read.
    KillPoint("boundary rollout | score (rollouts complete)",
              pause="rlpipe.stages.score.run:read_manifest@1", after=("iter_0000/rollouts",),
              before=("iter_0000/scores",)),
    KillPoint("boundary score | advantage (scores complete)",
              pause="rlpipe.stages.advantage.run:iter_shards@1", after=("iter_0000/scores",),
              before=("iter_0000/advantages",)),
    KillPoint("boundary advantage | optimize", after=("iter_0000/advantages",), before=("iter_0000/policy",)),
    # The policy goes to the next stage in memory and its files are written by a background
    # thread (stages/common/handoff.py): the kill lands with its weights written and no manifest,
    # while the main thread has moved on with the policy from memory.
    KillPoint("background policy checkpoint write (files written, no manifest)",
              pause="rlpipe.stages.common.handoff:write_manifest@1", before=("iter_0000/policy",)),
    KillPoint("boundary optimize | evaluate", after=("iter_0000/policy",), before=("iter_0000/eval",)),
    # The train state is written in a background thread after the policy: the kill lands while
    # that thread is inside DeepSpeed's save (the main thread has moved on to the evaluation).
    KillPoint("during the background train-state save (policy complete)",
              pause="rlpipe.stages.optimize.state:save_engines@1", before=("iter_0000/train_state",)),
    # A pause, not a poll: once its scores are written the evaluation's own metrics follow within
    # milliseconds, so a poll can land after them on a loaded machine. In this segment the initial
    # evaluation is a cache hit, so the first metrics write is iteration 0's.
    KillPoint("during evaluation of iteration 0 (scores done)",
              pause="rlpipe.stages.evaluate.run:write_table_artifact@1", before=("iter_0000/eval",)),
    KillPoint("boundary iteration 0 | iteration 1", after=("iter_0000/eval",), before=("iter_0001/rollouts",)),
]


class Zygote:
    """pause_driver.py --zygote: forks one `rlpipe` run per request."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, str(DRIVER), "--zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=ENV)
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def start(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> int:
        self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log), "env": env or {}}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["pid"]

    def wait(self) -> int:
        return json.loads(self.proc.stdout.readline())["exit"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _kill_at(zygote: Zygote, pid: int, run_dir: Path, point: KillPoint, pause_file: Path) -> tuple[bool, int]:
    """Poll for the point (5 ms), SIGKILL the run there; (reached, exit code)."""
    def reached() -> bool:
        if point.pause:  # (`after` is then checked once killed: too early)
            return pause_file.exists()
        return all((run_dir / a / MANIFEST).is_file() for a in point.after)

    deadline = time.monotonic() + 300
    while not reached() and time.monotonic() < deadline:
        try:  # still running? (a zombie until the zygote reaps it, so ask /proc)
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.005)
    hit = reached()
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return hit, zygote.wait()


def test_every_kill_point_resumes_to_the_uninterrupted_run(reference_run, tmp_path):
    reference = hashes(reference_run)
    run_dir = tmp_path / "killed" / "mini"
    argv = ["run", str(reference_run / "preset.yaml"), "--local", "--run-dir", str(run_dir)]
    results: list[tuple[str, str]] = []
    kept: dict[str, str] = {}  # manifests complete at some kill: must never be rewritten
    zygote = Zygote()
    for i, point in enumerate(POINTS):
        pause_file, log = tmp_path / f"paused-{i}", tmp_path / f"segment-{i}.log"
        env = {"RLPIPE_TEST_PAUSE": point.pause, "RLPIPE_TEST_PAUSE_FILE": str(pause_file)} if point.pause else {}
        hit, code = _kill_at(zygote, zygote.start(argv, log, env), run_dir, point, pause_file)
        if not hit or code != -signal.SIGKILL:
            results.append((point.name, f"not reached (exit {code}): {log.read_text()[-800:]!r}"))
            continue
        now = hashes(run_dir)
        wrong = {k: v for k, v in now.items() if reference.get(k) != v}
        early = [b for b in point.before if b in now]
        missing = [a for a in point.after if a not in now]
        partial = partial_artifacts(run_dir)
        problems = [f"differs from the reference: {sorted(wrong)}" if wrong else "",
                    f"killed too late, already complete: {early}" if early else "",
                    f"killed too early, not complete yet: {missing}" if missing else "",
                    f"partial artifacts visible: {partial}" if partial else ""]
        results.append((point.name, "; ".join(p for p in problems if p) or "identical"))
        kept |= {k: v for k, v in created(run_dir).items()}
    log = tmp_path / "final.log"
    zygote.start(argv, log)
    code = zygote.wait()
    zygote.close()
    assert code == 0, log.read_text()[-2000:]
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
