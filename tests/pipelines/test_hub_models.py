"""Models named by Hub id (`pipelines/hub_models.py`) against a Hugging Face cache this test lays
out itself, offline: nothing is downloaded, huggingface_hub's own resolution runs. Two revisions
whose weights differ: `org/name` reads main's, `org/name@v2` v2's; the run records id, revision
and commit, and a rerun reads the recorded commit after main moved."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import yaml
from test_user_errors import assert_user_error, cli

pytestmark = pytest.mark.hf

REPO = "rlpipe-test/tiny-policy"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_tokenizer):
    """$HF_HUB_CACHE/models--rlpipe-test--tiny-policy: refs main and v2, a snapshot each (seeds 0, 1)."""
    import huggingface_hub.constants as hub

    from rlpipe.stages.common.tiny import build_model, save_pretrained

    cache = tmp_path / "hub"
    repo = cache / f"models--{REPO.replace('/', '--')}"
    commits = {}
    for revision, seed in (("main", 0), ("v2", 1)):
        commit = hashlib.sha1(revision.encode()).hexdigest()
        save_pretrained(build_model(tiny_tokenizer, "causal", size="tiny", seed=seed), tiny_tokenizer,
                        repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / revision).write_text(commit)
        commits[revision] = commit
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache))  # (read once, at import)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    return repo, commits


def _preset(where: Path, base: str) -> Path:
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((1, 1), (2, 2), (2, 3), (3, 3))]
    (where / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {"name": "hub", "iterations": 1, "prompts_per_iteration": 2, "data": {"prompts": str(where / "p.jsonl")},
            "model": {"base": base}, "rollout": {"group_size": 2, "max_new_tokens": 2},
            "evaluate": {"max_new_tokens": 2}, "score": {"components": [{"name": "correct", "type": "answer_match"}]}}
    path = where / "hub.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _rollout_policy(run_dir: Path) -> Path:
    """The checkpoint iteration 0's rollout read (its saved config names it relative to itself)."""
    configs = run_dir / "iter_0000" / "configs"
    return Path(os.path.normpath(configs / yaml.safe_load((configs / "rollout.yaml").read_text())["checkpoint"]))


def test_a_hub_id_trains_from_the_cache_and_the_run_records_its_commit(tmp_path, hub_cache):
    repo, commits = hub_cache
    run_dir = tmp_path / "runs" / "hub"
    code, out = cli("run", _preset(tmp_path, REPO), "--local", "--run-dir", run_dir)
    assert code == 0, out
    assert f"model.base: {REPO} at main is commit {commits['main']}" in out
    record = json.loads((run_dir / "hub.json").read_text())
    assert record == {"model.base": {"id": REPO, "revision": "main", "commit": commits["main"],
                                     "path": str(repo / "snapshots" / commits["main"])}}
    assert _rollout_policy(run_dir) == repo / "snapshots" / commits["main"]
    assert yaml.safe_load((run_dir / "preset.yaml").read_text())["model"]["base"] == REPO  # (the id, as given)
    # main moves to v2's commit on the Hub: a rerun of this run reads the commit it recorded
    (repo / "refs" / "main").write_text(commits["v2"])
    code, out = cli("run", _preset(tmp_path, REPO), "--local", "--run-dir", run_dir)
    assert code == 0, out
    assert f"is commit {commits['main']}" in out and _rollout_policy(run_dir) == repo / "snapshots" / commits["main"]


def test_a_revision_picks_other_weights(tmp_path, hub_cache):
    import torch

    from rlpipe.stages.common.tiny import load_checkpoint

    repo, commits = hub_cache
    run_dir = tmp_path / "runs" / "hub"
    code, out = cli("run", _preset(tmp_path, f"{REPO}@v2"), "--local", "--run-dir", run_dir)
    assert code == 0, out
    assert _rollout_policy(run_dir) == repo / "snapshots" / commits["v2"]
    used = load_checkpoint(_rollout_policy(run_dir))[0].state_dict()
    main = load_checkpoint(repo / "snapshots" / commits["main"])[0].state_dict()
    assert not all(torch.equal(used[k], main[k]) for k in main)  # (seeds 1 and 0: other weights)


def test_an_id_neither_here_nor_in_the_cache_is_one_error_naming_both(tmp_path, hub_cache):
    code, out = cli("run", _preset(tmp_path, "rlpipe-test/no-such-model"), "--local", "--run-dir", tmp_path / "run")
    assert code == 2, out
    assert_user_error(out, "model.base", "rlpipe-test/no-such-model is neither a directory here nor in the Hugging "
                      "Face cache", "give a checkpoint directory")
    code, out = cli("run", _preset(tmp_path, f"{REPO}@v9"), "--local", "--run-dir", tmp_path / "run")
    assert code == 2, out
    assert_user_error(out, "model.base", REPO)
    assert not (tmp_path / "run").exists()


def test_a_stage_run_alone_takes_a_hub_id_for_its_checkpoint(tmp_path, hub_cache):
    """`rlpipe stage rollout checkpoint=org/name@v2` (and the same id in its YAML file) reads that
    revision's snapshot, says which commit, and its manifest records the snapshot it read."""
    from rlpipe.schemas import read_manifest

    repo, commits = hub_cache
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    assert cli("data", "import", tmp_path / "p.jsonl", tmp_path / "prompts")[0] == 0
    common = [f"prompts={tmp_path / 'prompts'}", "max_new_tokens=2", "group_size=2"]
    code, out = cli("stage", "rollout", f"checkpoint={REPO}@v2", f"output={tmp_path / 'r'}", *common)
    assert code == 0, out
    assert f"checkpoint: {REPO} at v2 is commit {commits['v2']}" in out
    snapshot = str(repo / "snapshots" / commits["v2"])
    assert read_manifest(tmp_path / "r").inputs["checkpoint"].path == snapshot
    # the same id written in a config file (relative paths there are the file's folder's, not an id's)
    (tmp_path / "rollout.yaml").write_text(yaml.safe_dump({"checkpoint": f"{REPO}@v2"}))
    code, out = cli("stage", "rollout", "-c", tmp_path / "rollout.yaml", f"output={tmp_path / 'r2'}", *common)
    assert code == 0, out
    assert read_manifest(tmp_path / "r2").inputs["checkpoint"].path == snapshot
    assert read_manifest(tmp_path / "r2").content_hash == read_manifest(tmp_path / "r").content_hash
    # neither a directory nor in the cache: one error naming the knob, the id, and both places
    code, out = cli("stage", "rollout", "checkpoint=rlpipe-test/no-such-model", f"output={tmp_path / 'r3'}", *common)
    assert code == 2, out
    assert_user_error(out, "checkpoint: rlpipe-test/no-such-model is neither a directory here nor in the Hugging "
                      "Face cache")


DATASET = "rlpipe-test/sums"


@pytest.fixture
def hub_dataset(tmp_path, monkeypatch, hub_cache):
    """$HF_HUB_CACHE/datasets--rlpipe-test--sums at main: data/train-*.parquet (4 sums) and
    data/test-*.parquet (2), as a dataset repository lays them out."""
    import datasets.config
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = tmp_path / "hub" / f"datasets--{DATASET.replace('/', '--')}"
    commit = hashlib.sha1(b"sums").hexdigest()
    data = repo / "snapshots" / commit / "data"
    data.mkdir(parents=True)
    for split, pairs in (("train", ((1, 1), (2, 2), (2, 3), (3, 3))), ("test", ((4, 1), (1, 4)))):
        rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
        pq.write_table(pa.Table.from_pylist(rows), data / f"{split}-00000-of-00001.parquet")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")  # (its Arrow cache)
    return repo / "snapshots" / commit


def test_a_hub_dataset_imports_by_id_and_a_run_records_its_commit(tmp_path, hub_dataset):
    from rlpipe.schemas import read_manifest, read_table_artifact

    code, out = cli("data", "import", DATASET, tmp_path / "train")
    assert code == 0, out
    assert f"source: {DATASET} at main is commit {hub_dataset.name}" in out
    rows = read_table_artifact(tmp_path / "train").to_pylist()  # the train split (of two)
    assert [(r["prompt"], r["answer"]) for r in rows] == [("1+1=", "2"), ("2+2=", "4"), ("2+3=", "5"), ("3+3=", "6")]
    assert read_manifest(tmp_path / "train").inputs["source"].path == str(hub_dataset)
    code, out = cli("data", "import", DATASET, tmp_path / "test", "--split", "test")
    assert code == 0 and read_table_artifact(tmp_path / "test").num_rows == 2, out
    code, out = cli("data", "import", DATASET, tmp_path / "few", "--data-files", "data/test-*.parquet")
    assert code == 0 and read_table_artifact(tmp_path / "few").num_rows == 2, out
    code, out = cli("data", "import", "rlpipe-test/no-such-data", tmp_path / "none")
    assert code == 2, out
    assert_user_error(out, "source: rlpipe-test/no-such-data is neither a path here nor in the Hugging Face cache")

    # a preset naming the dataset and a model by id: one iteration, both commits recorded
    spec = yaml.safe_load(_preset(tmp_path, REPO).read_text())
    spec["data"] = {"prompts": DATASET}
    (tmp_path / "hub.yaml").write_text(yaml.safe_dump(spec))
    run_dir = tmp_path / "runs" / "hub"
    code, out = cli("run", tmp_path / "hub.yaml", "--local", "--run-dir", run_dir)
    assert code == 0, out
    record = json.loads((run_dir / "hub.json").read_text())
    assert record["data.prompts"] == {"id": DATASET, "revision": "main", "commit": hub_dataset.name,
                                      "path": str(hub_dataset)}
    assert record["model.base"]["id"] == REPO
    assert read_table_artifact(run_dir / "data" / "prompts_train").num_rows == 4
