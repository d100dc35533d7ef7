"""The demo's base model: a tokenizer trained on the task's texts and a freshly initialised tiny
Llama (`rlpipe.stages.common.tiny`), saved as a checkpoint artifact (manifest written last).

Nothing is downloaded. Same texts, size and seed give the same checkpoint content hash, and a
second call with the same arguments returns the existing manifest without rebuilding.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from rlpipe.schemas import MANIFEST_NAME, Manifest, cache_key, cached_manifest, commit_directory

STAGE = "base_model"


def make_base_checkpoint(out_dir: Path | str, texts: Sequence[str], *, size: str = "demo", seed: int = 0,
                         vocab_size: int = 320, max_positions: int = 256, force: bool = False) -> Manifest:
    """Train a tokenizer on `texts`, build a causal tiny Llama of `size`, save it to `out_dir`.

    Args:
        texts: tokenizer training texts (e.g. `rlpipe.pipelines.tasks.tokenizer_texts(task)`).
        size: a key of `rlpipe.stages.common.tiny.SIZES` ('demo' is ~0.6M parameters).
        seed: initialisation seed.
    """
    import transformers

    from rlpipe.stages.common.tiny import build_model, save_pretrained, train_tokenizer

    transformers.utils.logging.disable_progress_bar()
    out = Path(out_dir)
    texts_hash = hashlib.sha256("\n".join(texts).encode()).hexdigest()
    config = {"size": size, "seed": seed, "vocab_size": vocab_size, "max_positions": max_positions,
              "texts_sha256": texts_hash, "output": str(out)}
    key = cache_key(STAGE, config, {})
    cached = cached_manifest(out, key)
    if cached is not None and not force:
        return cached
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    tokenizer = train_tokenizer(texts, vocab_size=vocab_size)
    model = build_model(tokenizer, "causal", size=size, seed=seed, max_positions=max_positions)
    save_pretrained(model, tokenizer, out)
    params = sum(p.numel() for p in model.parameters())
    return commit_directory(out, stage=STAGE, config=config, cache_key=key,
                            extra={"parameters": params, "vocab_size": len(tokenizer)})
