"""Fixtures of the rollout tests: prompts artifacts and the checks every rollouts artifact passes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from rlpipe.schemas import (
    PROMPTS,
    ROLLOUTS,
    read_manifest,
    read_table_artifact,
    validate_artifact,
    write_table_artifact,
)


def prompt_rows(n: int) -> dict[str, list]:
    """Prompts of clearly different token lengths (so batches are left-padded)."""
    texts = [f"Q: {i % 20}+{(7 * i) % 20}=" + " A:" * (i % 4) + f" {i}" * (2 * (i % 3)) for i in range(n)]
    return {"prompt_id": [f"p{i:03d}" for i in range(n)], "prompt": texts,
            "answer": [str(i % 20 + (7 * i) % 20) if i % 2 == 0 else None for i in range(n)],
            "metadata": [None] * n, "messages": [None] * n}


def write_prompts(path: Path, n: int) -> Path:
    write_table_artifact(path, PROMPTS, prompt_rows(n), stage="test")
    return path


@pytest.fixture(scope="session")
def prompts_dir(tmp_path_factory) -> Path:
    """12 prompts of 6 to 20 tokens."""
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts", 12)


def check_rollouts(path: Path, checkpoint: Path, *, group_size: int, max_new_tokens: int,
                   stop: tuple[str, ...] = (), stop_token_ids: tuple[int, ...] = (),
                   exact_text: bool = True) -> dict[str, int]:
    """Assert everything a rollouts artifact promises; returns counts of how responses ended.

    - schema and manifest valid; every group has samples 0..G-1, all in one shard;
    - stored log-probs == a teacher-forced forward pass of the checkpoint (1e-4);
    - finish reasons: 'length' means max_new_tokens tokens and no stop; 'stop' means the last token
      is EOS / a stop id, or the decoded tokens contain a stop string and the text is cut before it.
    """
    from rlpipe.stages.common.forward import teacher_forced_logprobs
    from rlpipe.stages.common.models import load_model

    assert validate_artifact(path) == []
    seen: dict[int, str] = {}
    for name in read_manifest(path).shard_names:
        for g in set(pq.read_table(Path(path) / name, columns=["group_id"])["group_id"].to_pylist()):
            assert g not in seen, f"group {g} split over {seen[g]} and {name}"
            seen[g] = name
    rows = read_table_artifact(path, ROLLOUTS).to_pylist()
    by_group: dict[int, list[int]] = {}
    for r in rows:
        by_group.setdefault(r["group_id"], []).append(r["sample_index"])
    assert all(sorted(v) == list(range(group_size)) for v in by_group.values())

    model, tok = load_model(checkpoint)
    ref = teacher_forced_logprobs(model, [r["prompt_token_ids"] for r in rows],
                                  [r["response_token_ids"] for r in rows], pad_id=tok.pad_token_id)
    for r, expected in zip(rows, ref, strict=True):
        assert len(r["response_logprobs"]) == len(r["response_token_ids"]) >= 1
        np.testing.assert_allclose(r["response_logprobs"], expected, atol=1e-4, rtol=0)

    stop_ids = {tok.eos_token_id, *stop_token_ids}
    counts = {"length": 0, "eos": 0, "stop_id": 0, "stop_string": 0}
    for r in rows:
        ids = r["response_token_ids"]
        full = tok.decode(ids, skip_special_tokens=True)
        hits = [full.find(s) for s in stop if s in full]
        assert set(ids[:-1]).isdisjoint(stop_ids), "a stop token inside a response"
        if r["finish_reason"] == "length":
            assert len(ids) == max_new_tokens and ids[-1] not in stop_ids and not hits
            counts["length"] += 1
        else:
            assert r["finish_reason"] == "stop"
            if ids[-1] in stop_ids:
                counts["eos" if ids[-1] == tok.eos_token_id else "stop_id"] += 1
            else:
                assert hits, f"'stop' without a stop token or stop string: {ids}"
                # the stop string ends in the last token: without it the text has none
                assert not any(s in tok.decode(ids[:-1], skip_special_tokens=True) for s in stop)
                counts["stop_string"] += 1
                cut = full[: min(hits)]
                assert r["response"] == cut if exact_text else cut.startswith(r["response"])
            assert len(ids) <= max_new_tokens
        assert not any(s in r["response"] for s in stop)
        if not hits:
            # vLLM's incremental detokenizer holds back a trailing incomplete UTF-8 sequence (random
            # models emit stray bytes), so its text may be a prefix of the full decode.
            assert r["response"] == full if exact_text else full.startswith(r["response"])
    return counts


@pytest.fixture(scope="session")
def rollout_check():
    """`check_rollouts` (test modules cannot import conftest under --import-mode=importlib)."""
    return check_rollouts


@pytest.fixture
def strict_sandbox():
    """The python tool's strict sandbox must work here: where it cannot, a test using it fails
    as root (CI: namespaces are a requirement there) and is skipped for other users, whose
    machines may forbid unprivileged user namespaces."""
    import os

    from rlpipe.stages.rollout.environments.sandbox import strict_sandbox_error

    why = strict_sandbox_error()
    if why and os.geteuid() != 0:
        pytest.skip(f"the strict sandbox cannot be set up here: {why}")
    assert why is None, f"the strict sandbox cannot be set up on this machine: {why}"
