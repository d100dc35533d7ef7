"""`python -m rlpipe.stages.advantage` / `rlpipe stage advantage`: advantages of saved scores."""

from __future__ import annotations

import sys

from rlpipe.stages.advantage.config import AdvantageConfig
from rlpipe.stages.common.cli import stage_main


def main(argv: list[str] | None = None) -> int:
    return stage_main("advantage", AdvantageConfig, "rlpipe.stages.advantage.run:run", argv)


if __name__ == "__main__":
    sys.exit(main())
