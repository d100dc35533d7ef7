"""glibc malloc settings for a process that runs the same stage order after order (a resident worker).

By default glibc returns freed memory to the operating system as soon as the free space at the top
of its heap passes a threshold, and serves large blocks with mmap, unmapped again when freed. A
resident member frees its step's tensors between orders while the other processes of the machine
run, so its next order gets the same blocks back as fresh pages, each a page fault that the kernel
zeroes: measured on a 2-core machine at 1M parameters (`benchmarks/bench_loop.py`, resident), 3,900
minor faults per rollout order and 1,600 per optimize order, against none in the one-process plain
loop doing the same work; the rollout member's order took 45 ms longer than the plain loop's
sampling. With the settings below: 10 and 260 faults, and 13 ms.

`keep_freed_memory` keeps up to TRIM_BYTES of freed heap for the next order and serves blocks of up
to MMAP_BYTES from the heap (larger ones, a whole policy's host copy at scale, are still mapped and
returned when freed). A user's own choice wins: nothing is changed where the environment sets
glibc's malloc knobs (MALLOC_*_ / GLIBC_TUNABLES) or preloads another allocator (LD_PRELOAD), and
nothing is done off glibc.
"""

from __future__ import annotations

import ctypes
import os
import platform

#: Freed heap kept for the next order (M_TRIM_THRESHOLD): a step's working set at the sizes where
#: the faults weigh; what a larger model frees beyond it goes back to the system as before.
TRIM_BYTES = 1 << 30
#: Blocks up to this size come from the heap (M_MMAP_THRESHOLD; 32 MiB is glibc's own upper bound
#: for the threshold it adjusts by itself).
MMAP_BYTES = 32 << 20

_M_TRIM_THRESHOLD = -1  # (malloc.h)
_M_MMAP_THRESHOLD = -3
#: The environment's say over malloc: any of these set, and the user's choice stands.
USER_KNOBS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
              "GLIBC_TUNABLES", "LD_PRELOAD")


def keep_freed_memory() -> str:
    """Apply the settings above to this process's glibc malloc; returns what was done, for the log."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "left as it is (not glibc)"
    user = [k for k in USER_KNOBS if os.environ.get(k)]
    if user:
        return f"left as the environment sets it ({', '.join(user)})"
    libc = ctypes.CDLL(None)  # (this process's own symbols, glibc's mallopt among them: no library search)
    if not (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES) and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES)):
        return "left as it is (mallopt refused the settings)"
    return f"keeps up to {TRIM_BYTES >> 20} MiB freed for the next order (blocks up to {MMAP_BYTES >> 20} MiB from the heap)"
