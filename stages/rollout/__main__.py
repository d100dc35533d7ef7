"""`python -m rlpipe.stages.rollout [-c config.yaml] [key=value ...]`: sample rollouts alone.

Example (the vLLM engine on CPU runs from its own venv, built by `make vllm-env`):
    python -m rlpipe.stages.rollout checkpoint=runs/demo/policy prompts=runs/demo/prompts \
        output=runs/demo/iter_0000/rollouts group_size=8 max_new_tokens=32
    .venv-vllm/bin/python -m rlpipe.stages.rollout engine=vllm checkpoint=... prompts=... output=...
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlpipe.stages.common.cli import stage_main
from rlpipe.stages.rollout.config import RolloutConfig


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("rollout", RolloutConfig, "rlpipe.stages.rollout.run:run", argv)


if __name__ == "__main__":  # the guard also keeps vLLM's worker processes from re-running the stage
    sys.exit(main())
