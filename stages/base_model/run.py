"""The base_model stage: a tokenizer trained on the given texts and a freshly initialised tiny
Llama (`rlpipe.stages.common.tiny`), saved as a checkpoint artifact (manifest written last).

Nothing is downloaded. The same texts, size and seed give the same checkpoint content hash, and
a rerun with the same config returns the existing manifest without rebuilding.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rlpipe.schemas import Manifest, commit_directory
from rlpipe.schemas.staging import staged_directory
from rlpipe.stages.base_model.config import BaseModelConfig
from rlpipe.stages.common.stage_io import StageStart, opens

STAGE = "base_model"


@opens(STAGE)
def run(config: BaseModelConfig, start: StageStart) -> Manifest:
    """Build and save the checkpoint of `config`; a cache hit returns the existing manifest."""
    import transformers

    from rlpipe.stages.common.tiny import build_model, save_pretrained, train_tokenizer

    key = start.key
    transformers.utils.logging.disable_progress_bar()
    tokenizer = train_tokenizer(config.tokenizer_texts, vocab_size=config.vocab_size)
    model = build_model(tokenizer, "causal", size=config.size, seed=config.seed,
                        max_positions=config.max_positions)
    params = sum(p.numel() for p in model.parameters())
    with staged_directory(config.output) as staging:  # the old checkpoint stays until complete
        save_pretrained(model, tokenizer, staging)
        return commit_directory(staging, stage=STAGE, config=config.resolved(), cache_key=key,
                                extra={"parameters": params, "vocab_size": len(tokenizer)})


def make_base_checkpoint(out_dir: Path | str, texts: Sequence[str], *, size: str = "demo", seed: int = 0,
                         force: bool = False) -> Manifest:
    """`run` with a config built from arguments (tests, benchmarks)."""
    config = BaseModelConfig(output=Path(out_dir), tokenizer_texts=tuple(texts), size=size, seed=seed)
    return run(config, force=force)
