"""LoRA (peft) for the optimize stage: the policy trains low-rank adapters on a frozen base.

For every targeted linear layer with frozen weight W (out x in), LoRA adds a trainable update
of rank r (Hu et al. 2021):

    h = W x + (alpha / r) * B A x          A: r x in (random init), B: out x r (zero init)

so the wrapped model starts equal to the base, and only A and B train (DeepSpeed builds its
optimizer over the parameters with requires_grad, i.e. the adapters; their AdamW state is what
the train state carries, beside the frozen base weights in its module state).

- `wrap`: the peft model around a causal LM, adapters initialised from a seed.
- `parameter_counts`: (trainable, total) parameters.
- `adapters_disabled`: the base model, the same module with its adapters off: the reference
  log-probs of a LoRA run (no second copy of the weights).
- `merged_model`: a plain Hugging Face model with W + (alpha / r) B A (what rollout / vLLM load).
- `save_adapter`: adapter_config.json + adapter_model.safetensors (peft's format).
- `check_state`: a train state continues only a run with the same LoRA knobs.
- `base_record`: which checkpoint the adapters sit on, for the manifest.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

#: The peft adapter name rlpipe uses (one adapter per policy).
ADAPTER = "default"
#: The folder of a LoRA policy checkpoint that holds the adapter (beside the merged weights).
ADAPTER_DIR = "adapter"


def _peft():
    try:
        import peft
    except ImportError as e:  # the optional extra
        raise ImportError("optimize.lora needs peft: pip install 'rlpipe[lora]'") from e
    return peft


def wrap(model: torch.nn.Module, *, r: int, alpha: float, target_modules: str | list[str], seed: int) -> Any:
    """The peft model around `model` (its base weights frozen), A initialised from `seed` (peft's
    default: Kaiming-uniform A, zero B), without touching the caller's global RNG."""
    peft = _peft()
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                             target_modules=target_modules)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return peft.get_peft_model(model, config, adapter_name=ADAPTER)
        except ValueError as e:  # target modules that match no layer of this architecture
            raise ValueError(f"optimize.lora.target_modules {target_modules!r}: {e}") from None


def is_lora(module: torch.nn.Module) -> bool:
    """Is `module` a peft model (a LoRA policy)?"""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(module, PeftModel)


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; shared (tied) tensors counted once."""
    seen: dict[int, torch.nn.Parameter] = {id(p): p for p in model.parameters()}
    trainable = sum(p.numel() for p in seen.values() if p.requires_grad)
    return trainable, sum(p.numel() for p in seen.values())


@contextlib.contextmanager
def adapters_disabled(engine: Any) -> Iterator[None]:
    """The engine's model with its adapters off: every LoRA layer returns its base layer's output
    exactly (peft skips the adapter branch), i.e. the model the adapters were attached to."""
    with engine.module.disable_adapter():
        yield


def _lora_layers(model: Any) -> dict[str, Any]:
    """{module name in the plain model: peft LoRA layer} of the peft model."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    return {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The plain model's state dict with the adapters merged, the peft model left untouched:

        W_merged = W + delta,   delta = peft's get_delta_weight = (alpha / r) B A  (transposed for
                                fan_in_fan_out layers)

    the same delta peft's own merge adds in place, so this equals `merge_and_unload()`'s weights."""
    layers = _lora_layers(model)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.get_base_model().state_dict().items():
        if ".lora_" in key:
            continue
        out[key.replace(".base_layer.", ".")] = value.detach().clone()
    for name, layer in layers.items():
        if ADAPTER not in layer.lora_A:
            continue
        weight = out[f"{name}.weight"]
        out[f"{name}.weight"] = (weight + layer.get_delta_weight(ADAPTER).to(weight.dtype))
    return out


def merged_model(model: Any) -> torch.nn.Module:
    """A plain Hugging Face model (the base architecture, no peft) with the merged weights."""
    base = model.get_base_model()
    plain = type(base)(base.config)
    plain.load_state_dict(merged_state_dict(model))
    if base.can_generate():
        plain.generation_config = base.generation_config
    return plain.to(next(base.parameters()).dtype).eval()


def save_adapter(model: Any, out_dir: Path) -> Path:
    """The adapter in peft's format: out_dir/adapter_config.json + adapter_model.safetensors.

    The config's `base_model_name_or_path` is left empty: checkpoint files hold no paths (a moved
    run keeps its content hashes); the base is named in the checkpoint's manifest (`base_record`).
    Load it with `PeftModel.from_pretrained(<base model>, out_dir)`."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = copy.copy(model.peft_config[ADAPTER])
    config.base_model_name_or_path = None
    if isinstance(config.target_modules, set | frozenset):  # peft keeps a set: write it in one order
        config.target_modules = sorted(config.target_modules)
    config.save_pretrained(str(out_dir))
    state = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model, adapter_name=ADAPTER).items()}
    save_file(state, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out_dir


def check_state(state: Path, lora: dict[str, Any] | None) -> None:
    """A train state continues only a run with the same LoRA knobs: its module holds the adapters
    of that shape and scale (or none), and alpha / r scales what they add."""
    from rlpipe.schemas import read_manifest

    saved = read_manifest(state).config.get("lora")
    if saved != lora:
        raise ValueError(f"train_state {state} was saved with optimize.lora = {saved} but this run has {lora}: "
                         "set optimize.lora as the run that saved it, or leave train_state unset to start afresh")


def base_record(policy: Path, continued: bool) -> dict[str, str]:
    """{path, content_hash} of the checkpoint the adapters sit on.

    A fresh adapter sits on `policy`. A continued one (from a train state) sits on whatever the
    run that saved the state started from: the input policy's own manifest names it when that
    policy is a LoRA checkpoint (its merged weights are not the base)."""
    from rlpipe.schemas import read_manifest
    from rlpipe.stages.common.models import checkpoint_key

    if continued:
        try:
            base = read_manifest(policy).extra.get("lora", {}).get("base")
        except Exception:  # a checkpoint without a manifest: not written by optimize
            base = None
        if base:
            return dict(base)
    return {"path": str(policy), "content_hash": checkpoint_key(policy)}
