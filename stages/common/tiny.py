"""Tiny tokenizers and models built locally (no downloads), for tests, benchmarks and the demo.

The tokenizer is a byte-level BPE trained with `tokenizers` on the given texts, with digits split
into single tokens (arithmetic stays learnable) and <|bos|>/<|eos|>/<|pad|> specials; BOS is added
to every encoded text. Models are Llama-architecture (rotary positions, so left padding only needs
the attention mask) with tied embeddings. Everything is saved and loaded in Hugging Face format,
so transformers, DeepSpeed and vLLM read them unchanged; reward models and critics are a causal
LM's backbone plus a scalar head (`scalar_head.py`).

`load_checkpoint` / `load_tokenizer` read any Hugging Face checkpoint, not only tiny ones: every
stage loads models and tokenizers through them.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from rlpipe.schemas.errors import UserError

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
_log = logging.getLogger(__name__)
_PAD_IS_EOS: set[str] = set()  # checkpoints whose "pad = eos" was already logged

#: Named model sizes: (hidden, layers, heads, kv_heads, intermediate).
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "micro": (32, 2, 2, 1, 64),  # ~25k params + embeddings: unit tests
    "tiny": (64, 2, 4, 2, 128),  # ~0.1M: stage tests
    "demo": (128, 4, 4, 2, 256),  # ~0.7M: the demo
    # benchmarks/bench_scale.py: the cost of an iteration as the model grows
    "1m": (160, 4, 4, 2, 448),  # ~1.2M
    "20m": (512, 6, 8, 4, 1536),  # ~19M
    "80m": (768, 12, 12, 4, 2304),  # ~83M
    "400m": (1024, 24, 16, 8, 4096),  # ~0.38B
    "1b": (2048, 22, 32, 4, 5632),  # ~0.97B (TinyLlama's shape)
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
        kind: 'causal' (LlamaForCausalLM), or 'reward' / 'critic' (its backbone with a scalar
            head, `ScalarHeadModel`; the head initialised N(0, 1 / (H + 1)^2)).
        size: a key of SIZES.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlpipe.stages.common.scalar_head import backbone_of, wrap

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
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    if kind != "causal":
        return wrap(*backbone_of(model), kind, init="normal", seed=seed)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def save_pretrained(model, tokenizer, out_dir: Path | str, max_shard_size: int | str = "5GB") -> Path:
    """Save model + tokenizer in Hugging Face format (safetensors): above `max_shard_size`, as
    several files plus `model.safetensors.index.json`, which transformers and vLLM load as one."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out)
    return out


def make_tiny_checkpoint(out_dir: Path | str, texts: Iterable[str], kind: ModelKind = "causal",
                         size: str = "tiny", seed: int = 0, vocab_size: int = 320) -> Path:
    """Train a tokenizer on `texts`, build a model, save both to `out_dir`; returns the path."""
    tokenizer = train_tokenizer(texts, vocab_size=vocab_size)
    model = build_model(tokenizer, kind=kind, size=size, seed=seed)
    return save_pretrained(model, tokenizer, out_dir)


def load_checkpoint(path: Path | str, kind: ModelKind = "causal", dtype: Any = None):
    """Load (model, tokenizer) from a Hugging Face directory in `dtype` (None: fp32), eval mode, as
    the current `model_loading` setting says (trust_remote_code, attn_implementation).

    kind: 'causal' (AutoModelForCausalLM), or 'reward' / 'critic' (a `ScalarHeadModel`: the rlpipe
    format, or a legacy 1-label sequence- / token-classification checkpoint).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from rlpipe.stages.common.model_loading import from_pretrained_kwargs
    from rlpipe.stages.common.scalar_head import (
        ScalarHeadCheckpointError,
        load_scalar_head_model,
        read_kind,
    )

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face checkpoint (no config.json)")
    refuse_code(path)
    try:
        if kind == "causal":
            if (stored := read_kind(path)) in ("critic", "reward"):
                raise ScalarHeadCheckpointError(f"{path} is a {stored} checkpoint (a scalar head), not a causal LM")
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32,
                                                         **from_pretrained_kwargs())
        else:
            model = load_scalar_head_model(path, kind)
            if dtype is not None and dtype != torch.float32:
                # the parameters only: buffers (rotary frequencies) stay fp32, as from_pretrained keeps them
                for param in model.parameters():
                    param.data = param.data.to(dtype)
    except pickle.UnpicklingError:  # torch.load(weights_only=True) refused a pickle: nothing of it ran
        raise pickled_code(path) from None
    model.eval()
    return model, load_tokenizer(path)


class UnsafeCheckpoint(UserError):
    """A checkpoint refused for what it holds: weights pickled with code that would run as they
    load, or a model or tokenizer transformers could only build by running the checkpoint's own
    code (`auto_map`) while `loading.trust_remote_code` is off. Nothing of it runs (torch loads
    .bin weights with weights_only whatever the knob); the message names the file."""


def refuse_code(path: Path) -> None:
    """Refuse a checkpoint whose config.json (or tokenizer_config.json) names code of its own in
    `auto_map` for an architecture (tokenizer class) transformers does not ship, unless the
    current setting trusts remote code; one it ships loads without that code, as transformers
    does without trust_remote_code."""
    import json

    import transformers

    from rlpipe.stages.common.model_loading import current

    if current().trust_remote_code:
        return

    def read(name: str) -> dict:
        try:
            data = json.loads((path / name).read_text())
        except (OSError, ValueError):  # (missing or unreadable: the loaders say so)
            return {}
        return data if isinstance(data, dict) else {}

    config, tokenizer = read("config.json"), read("tokenizer_config.json")
    if config.get("auto_map") and config.get("model_type") not in transformers.CONFIG_MAPPING:
        raise _runs_code(path / "config.json", f"model_type {config.get('model_type')!r}", config["auto_map"])
    if tokenizer.get("auto_map") and not hasattr(transformers, str(tokenizer.get("tokenizer_class"))):
        raise _runs_code(path / "tokenizer_config.json", f"tokenizer_class {tokenizer.get('tokenizer_class')!r}",
                         tokenizer["auto_map"])


def _runs_code(file: Path, what: str, auto_map: dict) -> UnsafeCheckpoint:
    code = ", ".join(str(v) for v in auto_map.values()) if isinstance(auto_map, dict) else str(auto_map)
    from rlpipe.stages.common.model_loading import TRUST_KNOB

    return UnsafeCheckpoint(f"{file}: {what} is not one transformers ships, and its auto_map names code in the "
                            f"checkpoint ({code}) that would have to run to build it; nothing of it ran. If you "
                            f"trust that code, set {TRUST_KNOB}; else use a checkpoint of an architecture "
                            "transformers has")


def pickled_code(path: Path) -> UnsafeCheckpoint:
    """The refusal of a checkpoint whose pickled weights (*.bin, *.pt) would run code, naming the
    first such file (each read again with weights_only: only on this failure's path)."""
    import torch

    for f in sorted(p for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth")):
        try:
            torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            lines = [line for line in str(e).splitlines()[1:] if line.strip() and "documentation" not in line]
            why = f" ({lines[0].strip()})" if lines else ""
            return UnsafeCheckpoint(
                f"{f}: its pickle would run code as it loads{why}; rlpipe loads weights as plain tensors only and "
                "refused it (nothing of it ran): use this checkpoint's weights as safetensors, converted where "
                "you trust the file")
    return UnsafeCheckpoint(f"{path}: its pickled weights would run code as they load; rlpipe refused them "
                            "(nothing of them ran): use the checkpoint's weights as safetensors")


def load_tokenizer(path: Path | str):
    """The checkpoint's tokenizer, with pad = eos when it defines no pad token (GPT-2, Llama and
    most base models ship none; every stage pads batches, always with an attention mask, so the
    pad id's value never reaches a loss). Logged once per checkpoint."""
    from transformers import AutoTokenizer

    from rlpipe.stages.common.model_loading import current

    trust = {"trust_remote_code": True} if current().trust_remote_code else {}
    tokenizer = AutoTokenizer.from_pretrained(path, **trust)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"the tokenizer of {path} has neither a pad nor an eos token: set "
                             f'"pad_token" in {Path(path) / "tokenizer_config.json"}')
        tokenizer.pad_token = tokenizer.eos_token
        if str(path) not in _PAD_IS_EOS:
            _PAD_IS_EOS.add(str(path))
            _log.warning("%s: the tokenizer has no pad token; padding with eos %r (id %d)", path,
                         tokenizer.eos_token, tokenizer.eos_token_id)
    return tokenizer
