"""How a stage loads Hugging Face models: trust_remote_code and attn_implementation.

One knob set for every stage that loads a model (`loading:` in its config; a preset's
`model.loading`, which the pipeline gives each of them): the stage's `run` makes it the process's
current setting for its duration (`stage_io.opens`), and every load below it (`tiny.load_checkpoint`,
the tokenizer, a scalar-head model, vLLM's engine) reads it with `current()`. So no call path
threads it, and a model loaded under one setting is never handed to a stage asking for another
(`models.py` keys its cache by it).

It says how the work runs, not what it computes, so it stays out of cache keys (`Runtime`): an
artifact made with `sdpa` attention is a cache hit for `eager` (the two differ at float rounding),
as one made on another device or thread count is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class ModelLoading(BaseModel):
    """How the stage loads Hugging Face models (policy, reference, reward model, critic)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    trust_remote_code: bool = False
    """Run a checkpoint's own code (its config's `auto_map`: modelling and tokenizer files shipped
    with it) for an architecture transformers does not ship. Off: such a checkpoint is refused with
    an error naming this knob, and nothing of its code runs. Turn it on only for checkpoints whose
    code you have read or trust: it runs with your permissions in every process that loads it."""
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"] | None = None
    """The attention kernels transformers uses (its `attn_implementation`): None leaves its default
    (`sdpa` where the architecture has it, else `eager`); `flash_attention_2` needs the flash-attn
    package and a GPU. vLLM picks its own attention backend (VLLM_ATTENTION_BACKEND)."""


#: Where a refusal points the user (the preset key; a stage run alone has `loading.trust_remote_code`).
TRUST_KNOB = "model.loading.trust_remote_code=true (a stage run alone: loading.trust_remote_code=true)"

_CURRENT = [ModelLoading()]


def current() -> ModelLoading:
    """The setting of the stage running in this process (the defaults outside any)."""
    return _CURRENT[-1]


@contextlib.contextmanager
def loading(setting: ModelLoading | None) -> Iterator[None]:
    """Make `setting` current for the block (None: the current one stays)."""
    _CURRENT.append(setting if setting is not None else _CURRENT[-1])
    try:
        yield
    finally:
        _CURRENT.pop()


#: What a stage computes in (a preset's `model.dtype`, each model-loading stage's `dtype`): 'auto'
#: is bf16 where CUDA is present and fp32 elsewhere (a CPU's bf16 matrix products are slow).
ComputeDtype = Literal["auto", "fp32", "bf16"]


def torch_dtype_names(value: Any) -> Any:
    """A dtype knob's value with torch's and vLLM's names read as ours (float32 -> fp32, ...)."""
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(value, value)


def compute_dtype(name: str) -> Any:
    """The torch dtype of a `ComputeDtype` (or 'fp16', which vLLM's older GPUs take)."""
    import torch

    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def from_pretrained_kwargs() -> dict[str, object]:
    """The keyword arguments of transformers' `from_pretrained` for the current setting (only the
    ones set, so transformers' defaults stay its own)."""
    setting = current()
    kwargs: dict[str, object] = {}
    if setting.trust_remote_code:
        kwargs["trust_remote_code"] = True
    if setting.attn_implementation is not None:
        kwargs["attn_implementation"] = setting.attn_implementation
    return kwargs
