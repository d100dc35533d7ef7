"""Config of the import_model stage: a GGUF file -> a Hugging Face checkpoint artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import field_validator

from rlpipe.schemas.config import Input, Output, StageConfig


class ImportModelConfig(StageConfig):
    """Import a pretrained causal language model from a GGUF file (llama.cpp's single-file format:
    weights, often quantised, with the tokenizer and chat template inside) as a Hugging Face
    checkpoint artifact: safetensors in `dtype`, the tokenizer with its chat template, and a
    manifest. transformers dequantises the weights (its `gguf` support, which needs the `gguf`
    package: `pip install 'rlpipe[gguf]'`)."""

    source: Annotated[Path, Input("file")]
    """The .gguf file, or a directory holding exactly one. The stage's cache key holds its content
    hash, not its path."""
    output: Annotated[Path, Output("checkpoint")]
    """Where the checkpoint goes (model + tokenizer + _manifest.json)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """The dtype the weights are saved in (the stages load a checkpoint in the precision they
    compute in, whatever it was saved in). bfloat16 halves float32's files and moves each weight
    of a Q4 or Q8 file by less than half its quantisation step (8 mantissa bits against the at
    most 7 of a block's integer times its scale)."""

    @field_validator("source")
    @classmethod
    def _the_gguf_file(cls, source: Path) -> Path:
        if not source.is_dir():
            return source
        found = sorted(source.glob("*.gguf"))
        if len(found) != 1:
            raise ValueError(f"{source} holds {len(found)} .gguf files ({', '.join(p.name for p in found) or 'none'}): "
                             "name the file to import")
        return found[0]
