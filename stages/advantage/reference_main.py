"""`python -m rlpipe.stages.advantage.reference_main` / `rlpipe stage reference`: per-token
reference log-probs and critic values of saved rollouts (parses the config before importing torch)."""

from __future__ import annotations

import sys

from rlpipe.stages.advantage.config import ReferenceConfig
from rlpipe.stages.common.cli import stage_main


def main(argv: list[str] | None = None) -> int:
    return stage_main("reference", ReferenceConfig, "rlpipe.stages.advantage.reference:run_reference", argv)


if __name__ == "__main__":
    sys.exit(main())
