"""The generation-engine interface and its registry.

An engine turns tokenised prompts into groups of sampled responses. Engines live in their own
modules (heavy imports stay there) and are registered here by name; `run.py` dispatches only
through `get_engine`.

Contract every engine keeps (tests check both engines against it):
- `generate(prompts, seeds, params)` returns, for prompt j, `params.group_size` samples drawn with
  seed `seeds[j]`, independent of the other prompts in the call.
- `Sample.token_ids` are the generated tokens, including the token that ended the response (EOS,
  a stop id, or the token that completed a stop string); `Sample.logprobs[t]` is
  log pi_theta(token_t | prompt, tokens_<t) from the policy's raw logits (temperature 1, before
  top-k/top-p), fp32.
- `Sample.text` is the decoded response with special tokens skipped, cut before a stop string.
- `finish_reason` is 'stop' (EOS, stop id, stop string) or 'length' (max_new_tokens reached).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rlpipe.stages.common.cli import import_ref


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling knobs shared by all engines (a view of the config, no IO)."""

    group_size: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Sample:
    """One sampled response; `token_ids` and `logprobs` have the same length."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


class Engine(Protocol):
    """What `run.py` needs from a generation engine."""

    name: str
    tokenizer: Any
    """A Hugging Face tokenizer of the checkpoint (prompts are tokenised with it)."""
    context_length: int
    """Maximum prompt + response length in tokens."""
    start_s: float
    """Seconds the engine took to start (load the model, start vLLM); after `generate` for lazy ones."""
    model_load: str | None
    """How it got the checkpoint's weights: 'cache' (already in memory), 'held' (its model held
    them), 'in_place' (copied into its running model), 'loaded' (a model or engine built)."""

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
                 params: SamplingSpec) -> list[list[Sample]]:
        """G samples for each prompt (outer list in prompt order, inner in sample order)."""
        ...


EngineFactory = Callable[..., Engine]

#: engine name -> 'module:factory'; factories take (checkpoint, config) and return an Engine.
ENGINES: dict[str, str] = {}


def register_engine(name: str, ref: str) -> None:
    """Register an engine factory by import reference ('module:callable'); names are unique."""
    if name in ENGINES:
        raise ValueError(f"rollout engine {name!r} is already registered ({ENGINES[name]})")
    ENGINES[name] = ref


def get_engine(name: str) -> EngineFactory:
    """The factory of engine `name` (imports its module only now)."""
    try:
        ref = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown rollout engine {name!r}; known: {sorted(ENGINES)}") from None
    return import_ref(ref)


register_engine("transformers", "rlpipe.stages.rollout.hf_engine:TransformersEngine")
register_engine("vllm", "rlpipe.stages.rollout.vllm_engine:VLLMEngine")
