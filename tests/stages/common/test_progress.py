"""The one progress display: plain lines off a terminal (logs), nothing on other ranks."""

from __future__ import annotations

import io
import re

from rlpipe.stages.common.progress import LineProgress, progress

LINE = re.compile(r"^sft: (\d+)/(\d+) \((\d+)%\) \S+ it/s, elapsed \S+(, ETA \S+)?(, loss=\S+)?$")


def test_lines_every_tenth_with_counts_and_stats():
    """StringIO is not a terminal, so lines come: one per 10% done (interval too long to matter)."""
    out = io.StringIO()
    with progress("sft", 25, enabled=True, stream=out, interval_s=1e9) as advance:
        for step in range(25):
            advance(loss=1.0 / (step + 1))
    lines = out.getvalue().splitlines()
    parsed = [LINE.match(line) for line in lines]
    assert all(parsed), lines
    # 10% of 25 is 2.5 steps: the line comes at the first step past each tenth.
    assert [int(m.group(1)) for m in parsed] == [3, 5, 8, 10, 13, 15, 18, 20, 23, 25]
    assert {int(m.group(2)) for m in parsed} == {25}
    assert [int(m.group(3)) for m in parsed] == [12, 20, 32, 40, 52, 60, 72, 80, 92, 100]
    assert lines[-1].endswith("loss=0.04")  # the latest stat, 1/25
    assert "ETA" not in lines[-1] and all("ETA" in line for line in lines[:-1])


def test_time_interval_rate_and_eta():
    """With a fake clock: a line whenever interval_s passes, rate = steps / elapsed, ETA = rest / rate."""
    now = [0.0]
    out = io.StringIO()
    lines = LineProgress("rollout", 1000, out, interval_s=5.0, clock=lambda: now[0])
    for _ in range(30):  # 30 steps, 1 s each: lines at t = 5, 10, ... (never at a 10% boundary)
        now[0] += 1.0
        lines.advance(1, tokens=7)
    text = out.getvalue().splitlines()
    assert len(text) == 6
    assert text[0] == "rollout: 5/1000 (0%) 1 it/s, elapsed 5s, ETA 16m35s, tokens=7"
    assert text[-1].startswith("rollout: 30/1000 (3%) 1 it/s, elapsed 30s, ETA 16m10s")
    lines.close()  # the final count was already shown: no repeat
    assert len(out.getvalue().splitlines()) == 6
    now[0] += 1.0
    lines.advance(2)
    lines.close()
    assert out.getvalue().splitlines()[-1].startswith("rollout: 32/1000 (3%)")


def test_disabled_writes_nothing():
    out = io.StringIO()
    with progress("sft", 10, enabled=False, stream=out) as advance:
        for _ in range(10):
            advance(loss=1.0)
    assert out.getvalue() == ""
