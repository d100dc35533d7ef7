"""The rollout's prompts are read and checked once per content (stages/rollout/prompt_memory.py)."""

from __future__ import annotations

import pytest

from rlpipe.schemas import PROMPTS, read_manifest, read_table_artifact, write_table_artifact
from rlpipe.stages.rollout import prompt_memory
from rlpipe.stages.rollout.prompt_memory import PROMPT_MEMORY

from .conftest import prompt_rows, write_prompts


def test_prompts_are_read_once_per_content_and_again_when_it_changes(tmp_path, monkeypatch):
    reads = []
    real = prompt_memory.read_table_artifact
    monkeypatch.setattr(prompt_memory, "read_table_artifact", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
    path = write_prompts(tmp_path / "prompts", 5)
    first = read_manifest(path).content_hash
    table = PROMPT_MEMORY.read(path, first)
    assert table.equals(read_table_artifact(path, PROMPTS))
    assert PROMPT_MEMORY.read(path, first) is table and reads == [path]  # the same content: not read again

    # the same path, rewritten with other prompts (a repeated id): read again, and refused
    rows = prompt_rows(5)
    rows["prompt_id"][3] = rows["prompt_id"][1]
    write_table_artifact(path, PROMPTS, rows, stage="test")
    changed = read_manifest(path).content_hash
    assert changed != first
    with pytest.raises(ValueError, match=rf"prompts artifact {path}: column 'prompt_id' repeats ids \('p001' at rows 1, 3"):
        PROMPT_MEMORY.read(path, changed)
    assert reads == [path, path]
    assert PROMPT_MEMORY.content_hash == first  # (what it holds is still the checked artifact)


def test_an_empty_prompts_artifact_is_refused(tmp_path):
    path = write_prompts(tmp_path / "prompts", 0)
    with pytest.raises(ValueError, match=rf"prompts artifact {path} has no rows: nothing to sample"):
        PROMPT_MEMORY.read(path, read_manifest(path).content_hash)
