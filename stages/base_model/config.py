"""Config of the base_model stage: tokenizer texts + model size -> a tiny checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator

from rlpipe.schemas.config import Output, StageConfig
from rlpipe.stages.common.tiny import SIZES


class BaseModelConfig(StageConfig):
    """Train a byte-level BPE tokenizer on `tokenizer_texts` and build a causal Llama of `size`
    with seeded random weights (`rlpipe.stages.common.tiny`); save both in Hugging Face format."""

    output: Annotated[Path, Output("checkpoint")]
    """Where the checkpoint goes (model + tokenizer + _manifest.json)."""
    tokenizer_texts: tuple[str, ...] = Field(min_length=1)
    """Texts the tokenizer is trained on (the pipeline passes the task's characters)."""
    size: str = "demo"
    """Model size, a name of `rlpipe.stages.common.tiny.SIZES` (micro: unit tests, tiny: ~0.1M
    parameters, demo: ~0.7M; 1m, 20m, 80m, 400m, 1b: about that many parameters, for
    benchmarks/bench_scale.py)."""
    vocab_size: int = Field(320, ge=16)
    """Tokenizer vocabulary size (specials and the 256 byte symbols included)."""
    max_positions: int = Field(256, ge=8)
    """Context length of the model (max_position_embeddings)."""
    seed: int = 0
    """Seeds the model's initialisation."""

    @field_validator("size")
    @classmethod
    def _known_size(cls, size: str) -> str:
        if size not in SIZES:
            raise ValueError(f"unknown model size {size!r}; known: {', '.join(SIZES)}")
        return size
