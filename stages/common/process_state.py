"""Process-wide state: what one process keeps between stages, and the one way to reset it.

In one process (the local runner, a resident worker) stages leave things for the stages after them,
on purpose: models stay loaded, engines stay warm, saves finish in the background. Each such concern
is one object, made once per process when the module that owns it is imported, with documented
fields and one `reset()` that puts it back as a fresh process has it:

- `PENDING` (`PendingWrites`, rlpipe.schemas.pending): artifacts whose manifest is decided while
  a background thread writes their files;
- `TABLES` (`TableMemory`, rlpipe.schemas.table_memory): the shards this process wrote or read, as tables;
- `BACKGROUND` (`BackgroundSaves`, rlpipe.stages.common.background): whether saves may run in the
  background, the saves in flight, their failures;
- `MODELS` (`ModelMemory`, rlpipe.stages.common.models): the model cache, the stages' slots,
  whether saved checkpoints are kept in the cache;
- `CHANNEL` (`WeightChannel`, rlpipe.stages.common.channel_end): this process's end of the
  weight channel between resident groups and the deliveries its current order takes;
- `LIVE` (`LiveEngine`, rlpipe.stages.rollout.vllm_engine): the live vLLM engine and its counts;
- `WARM` (`WarmEngines`, rlpipe.stages.optimize.replay): the optimize engines kept warm, by the
  id of the state they hold;
- `PROMPT_MEMORY` (`PromptMemory`, rlpipe.stages.rollout.prompt_memory): the content hash of the
  prompts whose rows the rollout checked last.

The objects of `schemas` and `stages.common` are listed here; a stage's own (a layer above this
module) registers itself with `register` as its module is imported: one that was never imported
holds nothing to reset.

Tests reset every one of them with `reset_process_state()` (the `fresh_process_state` fixture of
tests/conftest.py calls it before and after a test). It first waits for the saves in flight (they
use the warm engines and settle pending writes), then resets the stages' objects (the last
registered first), the weight channel, the models, the pending writes and the written tables.
"""

from __future__ import annotations

from typing import Protocol, TypeVar


class ProcessWide(Protocol):
    """An object that owns one concern's process-wide state."""

    def reset(self) -> None:
        """Back to the state of a fresh process."""


T = TypeVar("T", bound=ProcessWide)

#: The stages' process-wide objects, in the order their modules registered them.
_REGISTERED: list[ProcessWide] = []


def register(owner: T) -> T:
    """Make `owner` (a stage module's process-wide object) one that `reset_process_state` resets;
    returns it."""
    if not any(o is owner for o in _REGISTERED):
        _REGISTERED.append(owner)
    return owner


def reset_process_state() -> None:
    """Reset every process-wide object (see the module doc for the order)."""
    from rlpipe.schemas.pending import PENDING
    from rlpipe.schemas.table_memory import TABLES
    from rlpipe.stages.common.background import BACKGROUND
    from rlpipe.stages.common.channel_end import CHANNEL
    from rlpipe.stages.common.models import MODELS

    BACKGROUND.reset()
    for owner in reversed(_REGISTERED):
        owner.reset()
    CHANNEL.reset()
    MODELS.reset()
    PENDING.reset()
    TABLES.reset()
