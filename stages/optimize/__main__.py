"""`python -m rlpipe.stages.optimize -c cfg.yaml [key=value ...]`, alone or under a launcher:

    torchrun --nproc_per_node 2 -m rlpipe.stages.optimize -c cfg.yaml
    deepspeed --num_gpus 2 --module rlpipe.stages.optimize -c cfg.yaml
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from rlpipe.stages.common.cli import stage_main
from rlpipe.stages.optimize.config import OptimizeConfig


def _strip_local_rank(argv: Sequence[str]) -> list[str]:
    """The deepspeed launcher appends `--local_rank=N`; it becomes LOCAL_RANK."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg.startswith("--local_rank"):
            value = arg.partition("=")[2] or next(it, "0")
            os.environ.setdefault("LOCAL_RANK", value)
            continue
        out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = _strip_local_rank(sys.argv[1:] if argv is None else argv)
    return stage_main("optimize", OptimizeConfig, "rlpipe.stages.optimize.run:run", argv)


if __name__ == "__main__":
    sys.exit(main())
