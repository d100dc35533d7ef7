"""Models and data sets named by Hugging Face Hub id in a preset: `model.base: Qwen/Qwen2.5-0.5B-Instruct`,
`data.prompts: openai/gsm8k` (or `org/name@revision`) where no such local path exists, resolved
once per run.

Resolution goes through `huggingface_hub.snapshot_download` (stages/common/hub.py), so its cache
(`HF_HOME`, `HF_HUB_CACHE`), offline mode (`HF_HUB_OFFLINE=1`) and token are the user's as for any
Hugging Face tool; the stages then read the snapshot folder like any checkpoint directory or data
folder (on a cluster the cache must be on the shared filesystem, as the run directory is). The run
records what each id resolved to in `runs/<run>/hub.json` (key, id, revision asked, commit,
folder): a rerun or resume of that run uses the recorded commit even after the revision (`main`)
moved on the Hub, so its stages read the same weights and rows; a preset that asks for another id
or revision than the record resolves again.

An existing local path always wins over an id that happens to look the same.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from rlpipe.schemas.atomic import write_if_changed
from rlpipe.schemas.inputs import hub_reference
from rlpipe.stages.common.hub import HubModel, resolve

#: The preset keys that may name a Hub repository, and its type there.
HUB_KEYS = {"model.base": "model", "model.reward_model": "model", "data.prompts": "dataset",
            "data.eval_prompts": "dataset", "data.preferences": "dataset"}


def resolve_ids(section: str, values: dict[str, object], record_file: Path) -> tuple[dict[str, object], dict[str, HubModel]]:
    """`values` (a preset's `section`: model or data) with each Hub id replaced by its snapshot
    folder, and what each resolved to (by dotted key). A record of an earlier run of the same preset
    (`record_file`) pins the commit; the new record is written by `write_record` once the run
    directory is the run's."""
    recorded = _read(record_file)
    resolved, out = dict(values), {}
    for key, repo_type in HUB_KEYS.items():
        owner, _, name = key.partition(".")
        value = values.get(name) if owner == section else None
        ref = hub_reference(value) if value is not None else None
        if ref is None:
            continue
        repo_id, revision = ref
        pinned = recorded.get(key)
        same = pinned is not None and (pinned.id, pinned.revision) == (repo_id, revision)
        hub = resolve(key, repo_id, revision, commit=pinned.commit if same else None, repo_type=repo_type)
        resolved[name], out[key] = Path(hub.path), hub
    return resolved, out


def write_record(record_file: Path, resolved: dict[str, HubModel]) -> None:
    """runs/<run>/hub.json: what the run's Hub ids resolved to (nothing when it names none)."""
    if resolved:
        write_if_changed(record_file, (json.dumps({k: asdict(h) for k, h in resolved.items()}, indent=2) + "\n").encode())


def _read(record_file: Path) -> dict[str, HubModel]:
    try:
        data = json.loads(record_file.read_text())
    except (OSError, ValueError):
        return {}
    return {key: HubModel(**entry) for key, entry in data.items()}
