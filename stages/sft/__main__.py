"""`python -m rlpipe.stages.sft [-c FILE] [key=value ...]`: the SFT warm-start stage."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlpipe.stages.common.cli import stage_main
from rlpipe.stages.sft.config import SFTConfig


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("sft", SFTConfig, "rlpipe.stages.sft.run:run", argv)


if __name__ == "__main__":
    sys.exit(main())
