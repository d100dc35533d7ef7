"""`python -m rlpipe.stages.reward_model [-c FILE] [key=value ...]`: train a reward model."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlpipe.stages.common.cli import stage_main
from rlpipe.stages.reward_model.config import RewardModelConfig


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("reward_model", RewardModelConfig, "rlpipe.stages.reward_model.run:run", argv)


if __name__ == "__main__":
    sys.exit(main())
