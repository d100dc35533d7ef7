"""`python -m rlpipe.stages.score [-c FILE] [key=value ...]`: score rollouts."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlpipe.stages.common.cli import stage_main
from rlpipe.stages.score.config import ScoreConfig


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("score", ScoreConfig, "rlpipe.stages.score.run:run", argv)


if __name__ == "__main__":
    sys.exit(main())
