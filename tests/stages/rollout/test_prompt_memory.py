"""The rollout's prompts are checked once per content (stages/rollout/prompt_memory.py), and still
read and verified on every iteration."""

from __future__ import annotations

import pytest

from rlpipe.schemas import PROMPTS, read_manifest, read_table_artifact, write_table_artifact
from rlpipe.schemas.errors import IntegrityError
from rlpipe.stages.rollout import prompt_memory
from rlpipe.stages.rollout.prompt_memory import PROMPT_MEMORY

from .conftest import prompt_rows, write_prompts


def test_prompts_are_checked_once_per_content_and_again_when_it_changes(tmp_path, monkeypatch, fresh_process_state):
    checks = []
    real = prompt_memory.check_prompts
    monkeypatch.setattr(prompt_memory, "check_prompts", lambda t, p: checks.append(p) or real(t, p))
    path = write_prompts(tmp_path / "prompts", 5)
    first = read_manifest(path).content_hash
    assert PROMPT_MEMORY.read(path, first).equals(read_table_artifact(path, PROMPTS))
    assert PROMPT_MEMORY.read(path, first).num_rows == 5 and checks == [path]  # the same content: not again

    # the same path, rewritten with other prompts (a repeated id): checked again, and refused
    rows = prompt_rows(5)
    rows["prompt_id"][3] = rows["prompt_id"][1]
    write_table_artifact(path, PROMPTS, rows, stage="test")
    changed = read_manifest(path).content_hash
    assert changed != first
    with pytest.raises(ValueError, match=rf"prompts artifact {path}: column 'prompt_id' repeats ids \('p001' at rows 1, 3"):
        PROMPT_MEMORY.read(path, changed)
    assert checks == [path, path]


def test_a_damaged_file_of_checked_content_is_still_refused(tmp_path, fresh_process_state):
    path = write_prompts(tmp_path / "prompts", 5)
    content = read_manifest(path).content_hash
    PROMPT_MEMORY.read(path, content)
    shard = next(path.glob("part-*.parquet"))
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated under the same manifest
    with pytest.raises(IntegrityError, match=str(shard)):
        PROMPT_MEMORY.read(path, content)


def test_an_empty_prompts_artifact_is_refused(tmp_path):
    path = write_prompts(tmp_path / "prompts", 0)
    with pytest.raises(ValueError, match=rf"prompts artifact {path} has no rows: nothing to sample"):
        PROMPT_MEMORY.read(path, read_manifest(path).content_hash)
