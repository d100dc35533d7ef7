"""Tiny tokenizers and models built locally (no downloads), for tests, benchmarks and the demo.

The tokenizer is a byte-level BPE trained with `tokenizers` on the given texts, with digits split
into single tokens (arithmetic stays learnable) and <|bos|>/<|eos|>/<|pad|> specials; BOS is added
to every encoded text. Models are Llama-architecture (rotary positions, so left padding only needs
the attention mask) with tied embeddings. Everything is saved and loaded in Hugging Face format,
so transformers, DeepSpeed and vLLM read them unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Literal

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"

#: Named model sizes: (hidden, layers, heads, kv_heads, intermediate).
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "micro": (32, 2, 2, 1, 64),  # ~25k params + embeddings: unit tests
    "tiny": (64, 2, 4, 2, 128),  # ~0.1M: stage tests
    "demo": (128, 4, 4, 2, 256),  # ~0.7M: the demo
}

ModelKind = Literal["causal", "reward", "critic"]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 320):
    """Train a byte-level BPE tokenizer on `texts`; returns a `PreTrainedTokenizerFast`.

    Deterministic: the same texts and vocab size give the same vocabulary.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, padding_side="left",
        model_max_length=1024,
    )


def build_model(tokenizer, kind: ModelKind = "causal", size: str = "tiny", seed: int = 0,
                max_positions: int = 256):
    """A freshly initialised Llama model for `tokenizer` (seeded: same seed, same weights).

    Args:
        kind: 'causal' (LlamaForCausalLM) or 'reward' (LlamaForSequenceClassification, one label:
            a scalar head read at the last non-padding token).
        size: a key of SIZES.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; known: {sorted(SIZES)}")
    hidden, layers, heads, kv_heads, inter = SIZES[size]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=1,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        cls = LlamaForCausalLM if kind == "causal" else LlamaForSequenceClassification
        model = cls(config)
    if kind == "causal":
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def save_pretrained(model, tokenizer, out_dir: Path | str) -> Path:
    """Save model + tokenizer in Hugging Face format (safetensors)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def make_tiny_checkpoint(out_dir: Path | str, texts: Iterable[str], kind: ModelKind = "causal",
                         size: str = "tiny", seed: int = 0, vocab_size: int = 320) -> Path:
    """Train a tokenizer on `texts`, build a model, save both to `out_dir`; returns the path."""
    tokenizer = train_tokenizer(texts, vocab_size=vocab_size)
    model = build_model(tokenizer, kind=kind, size=size, seed=seed)
    return save_pretrained(model, tokenizer, out_dir)


def load_checkpoint(path: Path | str, kind: ModelKind = "causal"):
    """Load (model, tokenizer) from a Hugging Face directory, fp32, eval mode."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        AutoTokenizer,
    )

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face checkpoint (no config.json)")
    # 'critic': a value-head model (token classification, one label: V at every position).
    cls = {"causal": AutoModelForCausalLM, "reward": AutoModelForSequenceClassification,
           "critic": AutoModelForTokenClassification}[kind]
    model = cls.from_pretrained(path, dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
