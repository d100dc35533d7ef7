"""stages/common/allocator.py: a resident worker's glibc malloc keeps freed memory for its next
order, unless the user's environment chose otherwise. (What it saves is measured, not asserted:
`benchmarks/bench_loop.py` resident, docs/cluster.md.)"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from rlpipe.stages.common.allocator import USER_KNOBS

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# Six orders, each allocating and freeing 33 MB in 65 blocks below glibc's mmap threshold (heap
# blocks), in a process of its own; prints what keep_freed_memory said and each order's page faults.
ORDERS = """
import json, resource, torch
from rlpipe.stages.common.allocator import keep_freed_memory
said = keep_freed_memory()
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.empty(n).fill_(1.0) for n in [1 << 18, *([1 << 17] * 64)]]  # 1 MB, then 64 x 512 KB
    del blocks
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps([said, faults]))
"""

PAGES = 33 * (1 << 20) // 4096  # one order's blocks, in 4 KiB pages


def _orders(**env: str) -> tuple[str, list[int]]:
    clean = {k: v for k, v in os.environ.items() if k not in USER_KNOBS}
    out = subprocess.run([sys.executable, "-c", ORDERS], env=clean | env, capture_output=True, text=True, check=True)
    said, faults = json.loads(out.stdout.strip().splitlines()[-1])
    return said, faults


def test_freed_blocks_are_kept_for_the_next_order():
    said, faults = _orders()
    assert said.startswith("keeps up to 1024 MiB freed")
    # The first order faults its pages in (~8,400). The second reuses the freed heap (128-1,025
    # faults in five runs), where glibc by default has trimmed it and faults most of it in again
    # (8,034-8,162: its own threshold catches up only from the third order, a pattern the members'
    # orders never settle into); then at most a few hundred pages of bookkeeping.
    assert faults[0] > PAGES // 2 and faults[1] < PAGES // 4 and max(faults[2:]) < PAGES // 8, faults


def test_the_users_own_malloc_settings_are_left_alone():
    """MALLOC_TRIM_THRESHOLD_=5 (the user's): every order's blocks go back to the system and are
    faulted in again, so the setting above was not applied over it."""
    said, faults = _orders(MALLOC_TRIM_THRESHOLD_="5")
    assert said == "left as the environment sets it (MALLOC_TRIM_THRESHOLD_)"
    assert min(faults) > PAGES // 2, faults
