"""How a stage's run opens (stages/common/stage_io.py): its checkpoint inputs checked and identified
once per state of their folder, and checked again when that state changes."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Annotated

import pytest

from rlpipe.schemas import commit_directory
from rlpipe.schemas.config import Input, StageConfig
from rlpipe.schemas.errors import UserError
from rlpipe.stages.common import stage_io


class _Reads(StageConfig):
    policy: Annotated[Path, Input("checkpoint")]
    older: Annotated[list[Path], Input("checkpoint")] = []


def test_a_checkpoint_is_checked_once_per_state_of_its_folder(tiny_policy_dir, tmp_path, monkeypatch):
    ckpt = tmp_path / "policy"
    shutil.copytree(tiny_policy_dir, ckpt)
    first = commit_directory(ckpt, stage="optimize")
    plain = tmp_path / "hf"  # (no manifest: a Hugging Face folder, checked every time)
    shutil.copytree(tiny_policy_dir, plain)
    checked: list[str] = []
    real = stage_io.input_problem
    monkeypatch.setattr(stage_io, "input_problem", lambda path, kind: checked.append(Path(path).name) or real(path, kind))
    config = _Reads(policy=ckpt, older=[plain])

    refs = stage_io.input_refs(config)
    assert refs["policy"].content_hash == first.content_hash and checked == ["policy", "hf"]
    again = stage_io.input_refs(config)
    assert again == refs and checked == ["policy", "hf", "hf"]  # the manifest's checkpoint not again

    # rewritten (a new manifest): checked and identified anew
    (ckpt / "extra.txt").write_text("x")
    second = commit_directory(ckpt, stage="optimize")
    assert second.content_hash != first.content_hash
    assert stage_io.input_refs(config)["policy"].content_hash == second.content_hash
    assert checked.count("policy") == 2

    # a file gone from the folder (its mtime changes): checked, and the problem named. (File times
    # tick with the kernel's coarse clock, up to 10 ms: a change within the tick of the last check
    # keeps the folder's mtime; its files' hashes are verified when read either way.)
    time.sleep(0.05)
    (ckpt / "config.json").unlink()
    with pytest.raises(UserError, match="no config.json"):
        stage_io.input_refs(config)
