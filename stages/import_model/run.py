"""The import_model stage: transformers reads the GGUF file (config, tokenizer, chat template and
weights, dequantised to float32); the model is rebuilt from its config without the quantisation
marker transformers leaves on it (`save_pretrained` refuses a model so marked), given the
dequantised weights, and saved in `dtype` with the tokenizer as a checkpoint artifact (manifest
written last, the old checkpoint kept until the new one is complete).
"""

from __future__ import annotations

import time
from typing import Any

from rlpipe.schemas import Manifest, commit_directory
from rlpipe.schemas.errors import UserError
from rlpipe.schemas.staging import staged_directory
from rlpipe.stages.common.stage_io import StageStart, opens
from rlpipe.stages.import_model.config import ImportModelConfig

STAGE = "import_model"


@opens(STAGE)
def run(config: ImportModelConfig, start: StageStart) -> Manifest:
    """Import `config.source`; a cache hit (same file content and dtype) returns the existing manifest."""
    import torch

    from rlpipe.stages.common.tiny import save_pretrained

    tokenizer, loaded = _read_gguf(config)
    model = _unmarked(loaded, getattr(torch, config.dtype))
    params = sum(p.numel() for p in model.parameters())
    with staged_directory(config.output) as staging:
        save_pretrained(model, tokenizer, staging)
        return commit_directory(staging, stage=STAGE, config=config.resolved(), inputs=start.inputs,
                                cache_key=start.key, wall_time_s=time.time() - start.started, extra={
                                    "parameters": params, "architecture": model.config.architectures[0],
                                    "vocab_size": len(tokenizer), "source_file": config.source.name,
                                    "chat_template": bool(getattr(tokenizer, "chat_template", None))})


def _read_gguf(config: ImportModelConfig) -> tuple[Any, Any]:
    """(tokenizer, model) as transformers reads the file; a file it cannot read is the user's to
    know, with the file and transformers' reason."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    folder, name = config.source.parent, config.source.name
    try:
        import gguf  # noqa: F401 (transformers reads GGUF files with it)
    except ImportError:
        raise UserError("importing a GGUF file needs the `gguf` package: pip install 'rlpipe[gguf]'") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError, OSError) as e:
        # (an architecture or a quantisation type transformers' GGUF support lacks, a truncated file)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{config.source}: transformers cannot import this GGUF file: {reason}. Its GGUF support "
                        "covers the architectures and quantisation types listed in transformers' GGUF guide; "
                        "another file of the same model (another quantisation) may import") from None
    return tokenizer, model


def _unmarked(loaded: Any, dtype: Any) -> Any:
    """`loaded` as a plain model in `dtype`: rebuilt from its config (without the quantisation
    marker) and given its weights, tied ones tied again."""
    from transformers import AutoModelForCausalLM

    model_config = loaded.config
    if hasattr(model_config, "quantization_config"):  # (the marker: the weights are dequantised)
        delattr(model_config, "quantization_config")
    model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = set(getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or ())
    if unexpected or set(missing) - tied:
        raise UserError(f"the imported weights do not fit the model's architecture: missing {sorted(missing)[:5]}, "
                        f"unexpected {sorted(unexpected)[:5]}")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    return model.eval()
