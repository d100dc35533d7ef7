"""The process-wide state (stages/common/process_state.py): one object per concern, and one call
that puts them all back as a fresh process has them."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from rlpipe.schemas.pending import PENDING, pending_manifest, register
from rlpipe.stages.common import background
from rlpipe.stages.common.models import MODELS, keep_saved_checkpoints, keeps_saved_checkpoints
from rlpipe.stages.common.process_state import _REGISTERED, reset_process_state
from rlpipe.stages.optimize.replay import WARM, keep_warm
from rlpipe.stages.rollout.vllm_engine import LIVE


class _Destroyed:
    """Stands for a warm engine pair: records that it was destroyed."""

    def __init__(self) -> None:
        self.destroyed = False

    def destroy(self) -> None:
        self.destroyed = True


def test_one_call_resets_every_process_wide_object(tmp_path):
    assert {type(o).__name__ for o in _REGISTERED} >= {"WarmEngines", "LiveEngine"}
    register(tmp_path / "a", SimpleNamespace(content_hash="h"), wait=lambda: None)  # (a manifest)
    background.allow_background()
    gate, saved = threading.Event(), []
    background.in_background(lambda: (gate.wait(), saved.append(1)), "a save")
    keep_saved_checkpoints(False)
    MODELS.cache[("k", "causal")] = (object(), object())
    engines = _Destroyed()
    keep_warm(engines, "saved:x")
    LIVE.counts["starts"] += 1
    threading.Timer(0.2, gate.set).start()

    reset_process_state()

    assert saved == [1]  # the save in flight was waited for
    assert not background.background_allowed() and not background.BACKGROUND.pending
    assert pending_manifest(tmp_path / "a") is None and not PENDING.entries
    assert keeps_saved_checkpoints() and not MODELS.cache and not MODELS.slots
    assert engines.destroyed and not WARM.by_state
    assert LIVE.current is None and set(LIVE.counts.values()) == {0}
