"""Run the optimize stage's CLI entry point once per YAML config, in one process per rank.

Launched by test_invariance.py as `torchrun --nproc_per_node 2 torchrun_driver.py a.yaml b.yaml`:
one process start for several runs, which also exercises repeated DeepSpeed init in one process.
"""

import sys

from rlpipe.stages.optimize.__main__ import main

if __name__ == "__main__":
    for cfg in sys.argv[1:]:
        code = main(["-c", cfg])
        if code:
            sys.exit(code)
