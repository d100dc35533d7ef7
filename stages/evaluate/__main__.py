"""`python -m rlpipe.stages.evaluate [-c FILE] [key=value ...]`: held-out greedy evaluation."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlpipe.stages.common.cli import stage_main
from rlpipe.stages.evaluate.config import EvaluateConfig


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("evaluate", EvaluateConfig, "rlpipe.stages.evaluate.run:run", argv)


if __name__ == "__main__":
    sys.exit(main())
