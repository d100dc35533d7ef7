"""The local runner hands optimize's policy to the next rollout in memory and writes its checkpoint
in the background (stages/common/handoff.py): every artifact of the run must equal, by content, the
run whose stages read each policy from its file."""

from __future__ import annotations

import pytest
import yaml
from conftest import MINI
from reliability.helpers import hashes

from rlpipe.pipelines.preset import load_preset
from rlpipe.pipelines.runner import Pipeline
from rlpipe.schemas import pending
from rlpipe.stages.common import models
from rlpipe.stages.optimize.run import clear_warm

pytestmark = pytest.mark.integration


def _run(tmp_path, name: str, keep_saved: bool, zero_stage: int) -> dict[str, str]:
    models.clear_cache()
    clear_warm()
    models.keep_saved_checkpoints(keep_saved)
    preset_file = tmp_path / f"{name}.yaml"
    preset_file.write_text(yaml.safe_dump({**MINI, "iterations": 3,
                                           "optimize": {**MINI["optimize"], "zero_stage": zero_stage}}))
    try:
        lines: list[str] = []
        Pipeline(load_preset(preset_file), tmp_path / name / "mini", log=lines.append).run()
    finally:
        models.keep_saved_checkpoints(True)
        models.clear_cache()
        clear_warm()
    return hashes(tmp_path / name / "mini")


# ZeRO 3: the policy is gathered module by module onto the engine's device and that copy itself is
# handed over (`hand_over(..., disposable=True)`), not copied once more
@pytest.mark.parametrize("zero_stage", [0, 3])
def test_rollouts_after_the_in_memory_hand_over_equal_those_read_from_the_file(tmp_path, monkeypatch, zero_stage):
    handed: list[str] = []
    from rlpipe.stages.common import handoff

    real = handoff.hand_over
    monkeypatch.setattr(handoff, "hand_over", lambda *a, **k: handed.append(str(a[2])) or real(*a, **k))
    in_memory = _run(tmp_path, "in_memory", keep_saved=True, zero_stage=zero_stage)
    from_files = _run(tmp_path, "from_files", keep_saved=False, zero_stage=zero_stage)
    assert [p.split("/")[-2] for p in handed] == ["iter_0000", "iter_0001", "iter_0002"]  # it was used
    assert pending.pending_manifest(handed[-1]) is None
    assert in_memory == from_files
    assert {"iter_0002/rollouts", "iter_0002/policy", "iter_0002/eval"} <= in_memory.keys()
