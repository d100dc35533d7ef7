"""Scalar-head models for every causal-LM architecture: critics (value models) and reward models.

A `ScalarHeadModel` is a causal LM's backbone (its `base_model`: LlamaModel, GPT2Model,
BloomModel, OPTModel, ...: whatever attribute the architecture keeps it in) plus one linear
output per position on the backbone's last hidden states h:

    out[b, i] = w . h[b, i] + c                                     (B, L, 1) as `.logits`

A critic reads it at position P_b + t - 1 (V_t, the value of the state before response token t;
see forward.py); a reward model reads it at the last non-pad token (modeling.py). Nothing depends
on AutoModelForTokenClassification / AutoModelForSequenceClassification existing for the
architecture (GPT-2, GPT-NeoX, OPT and Bloom have no token-classification class with a `.model`).

On disk, one Hugging Face directory:

    config.json               the backbone's config (architectures: ["LlamaModel"], ...) plus
                              "rlpipe_scalar_head": {"kind": "critic" | "reward", "hidden_size": H,
                                                     "bias": true | false}
    model.safetensors         the backbone in Hugging Face format (`AutoModel.from_pretrained` reads it)
    scalar_head.safetensors   the head: {"weight": (1, H)} (+ "bias": (1,))

Reward heads have no bias (as `*ForSequenceClassification` and OpenRLHF): the Bradley-Terry loss
depends on reward differences only, so a bias would get a zero gradient that Adam turns into
noise-driven steps. Critic heads have one (a value baseline).
    tokenizer files

Older checkpoints load unchanged: a 1-label `*ForSequenceClassification` (reward models written
before this format, and most reward models published on the Hub) or `*ForTokenClassification`
(earlier critics) is read into the same wrapper from its backbone and its `score` / `classifier`
layer. Every writer writes the format above.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

HeadKind = Literal["critic", "reward"]
HeadInit = Literal["zero", "normal"]

MARKER = "rlpipe_scalar_head"
"""The config.json key that marks a scalar-head checkpoint."""
HEAD_FILE = "scalar_head.safetensors"
_LEGACY = {"ForSequenceClassification": "reward", "ForTokenClassification": "critic"}


class ScalarHeadCheckpointError(ValueError):
    """A checkpoint cannot be read as a critic / reward model."""


class ScalarHeadModel(nn.Module):
    """backbone + nn.Linear(H, 1) at every position; `forward(...).logits` is (B, L, 1).

    Constructed from a config carrying the `rlpipe_scalar_head` entry (a fresh backbone, as
    `type(model)(model.config)` does for Hugging Face models), or around an existing backbone.
    """

    def __init__(self, config: Any, backbone: nn.Module | None = None):
        super().__init__()
        from transformers import AutoModel

        spec = getattr(config, MARKER, None)
        if not isinstance(spec, dict) or spec.get("kind") not in ("critic", "reward"):
            raise ScalarHeadCheckpointError(f"config has no valid {MARKER!r} entry: {spec!r}")
        self.config = config
        self.backbone = backbone if backbone is not None else AutoModel.from_config(config)
        self.head = nn.Linear(int(spec["hidden_size"]), 1, bias=bool(spec.get("bias", True)))

    @property
    def kind(self) -> HeadKind:
        return self.config.rlpipe_scalar_head["kind"]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any):
        from transformers.modeling_outputs import TokenClassifierOutput

        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, **{"use_cache": False, **kwargs}
                               ).last_hidden_state
        return TokenClassifierOutput(logits=self.head(hidden.to(self.head.weight.dtype)))

    # The parts of the Hugging Face model interface the training engines use.
    def can_generate(self) -> bool:
        return False

    def get_input_embeddings(self) -> nn.Module:
        return self.backbone.get_input_embeddings()

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        self.backbone.gradient_checkpointing_enable(**kwargs)

    def save_pretrained(self, out_dir: Path | str, state_dict: dict[str, torch.Tensor] | None = None,
                        safe_serialization: bool = True, max_shard_size: int | str = "5GB") -> None:
        """Write the backbone (Hugging Face format) and the head (scalar_head.safetensors).

        `state_dict` (keys `backbone.*`, `head.*`), when given, replaces the module's own tensors
        (a gathered ZeRO-3 state on rank 0)."""
        from safetensors.torch import save_file

        if not safe_serialization:
            raise ValueError("scalar-head checkpoints are written as safetensors only")
        out = Path(out_dir)
        state = self.state_dict() if state_dict is None else state_dict
        parts: dict[str, dict[str, torch.Tensor]] = {"backbone": {}, "head": {}}
        for name, tensor in state.items():
            part, _, rest = name.partition(".")
            parts[part][rest] = tensor
        self.backbone.save_pretrained(out, state_dict=parts["backbone"], safe_serialization=True,
                                      max_shard_size=max_shard_size)
        save_file({k: v.detach().cpu().contiguous() for k, v in parts["head"].items()}, out / HEAD_FILE)


def backbone_of(causal_lm: nn.Module) -> tuple[nn.Module, int]:
    """(backbone, H) of a causal LM: its `base_model` and the width of the hidden states its LM head
    reads (`lm_head.in_features`; OPT's projected width, not its `hidden_size`, for example)."""
    backbone = causal_lm.base_model
    if backbone is causal_lm:
        raise ScalarHeadCheckpointError(
            f"{type(causal_lm).__name__} has no backbone under base_model_prefix "
            f"{causal_lm.base_model_prefix!r}: not a causal LM with a separate LM head")
    head = causal_lm.get_output_embeddings()
    if isinstance(head, nn.Linear):
        return backbone, head.in_features
    return backbone, int(causal_lm.config.get_text_config().hidden_size)


def wrap(backbone: nn.Module, hidden_size: int, kind: HeadKind, *, init: HeadInit = "zero", seed: int = 0,
         weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
         has_bias: bool | None = None) -> ScalarHeadModel:
    """A ScalarHeadModel around `backbone` (used as is: copy it first if it is shared).

    The head is `weight` / `bias` when given, else initialised: 'zero' (output 0 everywhere) or
    'normal' (weight ~ N(0, 1 / (H + 1)^2), bias 0, as OpenRLHF), seeded by `seed`. It has a bias
    when `has_bias` (default: a critic's does, a reward model's does not).
    """
    has_bias = (kind == "critic" if weight is None else bias is not None) if has_bias is None else has_bias
    config = backbone.config
    setattr(config, MARKER, {"kind": kind, "hidden_size": int(hidden_size), "bias": has_bias})
    model = ScalarHeadModel(config, backbone)
    with torch.no_grad():
        if model.head.bias is not None:
            model.head.bias.zero_()
        if weight is not None:
            model.head.weight.copy_(weight.reshape(1, hidden_size))
            if bias is not None and model.head.bias is not None:
                model.head.bias.copy_(bias.reshape(1))
        elif init == "zero":
            model.head.weight.zero_()
        elif init == "normal":
            gen = torch.Generator().manual_seed(seed)
            model.head.weight.copy_(torch.randn(1, hidden_size, generator=gen) / (hidden_size + 1))
        else:
            raise ValueError(f"head init must be 'zero' or 'normal', got {init!r}")
    return model.to(next(backbone.parameters()).dtype).eval()


def read_kind(path: Path | str) -> str:
    """What config.json says a checkpoint is: 'critic' / 'reward' (ours or a legacy 1-label
    classification model), 'causal', or the architectures list as a string otherwise."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    if isinstance(cfg.get(MARKER), dict):
        return str(cfg[MARKER].get("kind"))
    archs = cfg.get("architectures") or []
    for suffix, kind in _LEGACY.items():
        if any(a.endswith(suffix) for a in archs):
            return kind
    if any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs):
        return "causal"
    return str(archs or "a model of unknown architecture")


def load_scalar_head_model(path: Path | str, kind: HeadKind, *, new_head: HeadInit | None = None,
                           seed: int = 0) -> ScalarHeadModel:
    """A ScalarHeadModel from `path` (fp32, eval mode).

    Reads the rlpipe format, or a legacy 1-label `*ForSequenceClassification` /
    `*ForTokenClassification` model (its head kept). A causal-LM checkpoint gets a fresh head
    initialised with `new_head` (seeded) when that is given, and is refused otherwise. The
    stored kind may differ from `kind` (a reward model can start a critic); the result has `kind`.
    """
    from safetensors.torch import load_file
    from transformers import (
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    from rlpipe.stages.common.model_loading import from_pretrained_kwargs

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ScalarHeadCheckpointError(f"{path} is not a Hugging Face checkpoint (no config.json)")
    cfg = json.loads((path / "config.json").read_text())
    stored = read_kind(path)
    if isinstance(cfg.get(MARKER), dict):
        backbone = AutoModel.from_pretrained(path, dtype=torch.float32, **from_pretrained_kwargs())
        head = load_file(path / HEAD_FILE)
        return wrap(backbone, cfg[MARKER]["hidden_size"], kind, weight=head["weight"], bias=head.get("bias"))
    if stored in ("critic", "reward"):
        cls = AutoModelForSequenceClassification if stored == "reward" else AutoModelForTokenClassification
        legacy = cls.from_pretrained(path, dtype=torch.float32, **from_pretrained_kwargs())
        if legacy.config.num_labels != 1:
            raise ScalarHeadCheckpointError(
                f"{path}: a {legacy.config.num_labels}-label {type(legacy).__name__}; a {kind} has exactly 1 label")
        layer = getattr(legacy, "score", None) or getattr(legacy, "classifier", None)
        if not isinstance(layer, nn.Linear):
            raise ScalarHeadCheckpointError(f"{path}: {type(legacy).__name__} has no linear `score` head")
        return wrap(legacy.base_model, layer.in_features, kind, weight=layer.weight, bias=layer.bias)
    if stored == "causal" and new_head is not None:
        backbone, hidden = backbone_of(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **from_pretrained_kwargs()))
        return wrap(backbone, hidden, kind, init=new_head, seed=seed)
    raise ScalarHeadCheckpointError(
        f"{path} is {'a causal LM' if stored == 'causal' else stored}, not a {kind} checkpoint "
        f"(build one with the {'critic_init' if kind == 'critic' else 'reward_model'} stage)")
