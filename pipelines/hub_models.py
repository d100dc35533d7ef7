"""Models named by Hugging Face Hub id: `model.base: Qwen/Qwen2.5-0.5B-Instruct` (or
`org/name@revision`) where no such local directory exists, resolved once per run.

Resolution goes through `huggingface_hub.snapshot_download`, so its cache (`HF_HOME`,
`HF_HUB_CACHE`), offline mode (`HF_HUB_OFFLINE=1`) and token are the user's as for any Hugging Face
tool; the stages then read the snapshot folder like any checkpoint directory (on a cluster the
cache must be on the shared filesystem, as the run directory is). The run records what each id
resolved to in `runs/<run>/hub.json` (id, revision asked, commit, folder): a rerun or resume of that
run uses the recorded commit even after the revision (`main`) moved on the Hub, so its stages read
the same weights; a preset that asks for another id or revision than the record resolves again.

An existing local path always wins over an id that happens to look the same.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from rlpipe.schemas.atomic import write_if_changed
from rlpipe.schemas.errors import UserError

#: The preset keys that name a model (a checkpoint directory, or a Hub id).
MODEL_KEYS = ("base", "reward_model")

#: org/name, as the Hub spells repository ids (no leading '.', no '..'), with an optional @revision.
_HUB_ID = re.compile(r"^(?P<id>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")


@dataclass(frozen=True)
class HubModel:
    """What one id resolved to."""

    id: str
    """The repository id, org/name."""
    revision: str
    """The revision asked for (a branch, tag or commit; `main` when none was given)."""
    commit: str
    """The commit it resolved to: what a rerun reads."""
    path: str
    """The snapshot folder in the Hub cache."""


def hub_reference(value: Path | str) -> tuple[str, str] | None:
    """(id, revision) when `value` is no local path and reads as org/name[@revision]; else None."""
    text = str(value)
    if Path(text).exists():
        return None
    m = _HUB_ID.match(text)
    return (m["id"], m["revision"] or "main") if m else None


def resolve_models(model: dict[str, object], record_file: Path) -> tuple[dict[str, object], dict[str, HubModel]]:
    """`model` (a preset's model section) with each Hub id replaced by its snapshot folder, and
    what each resolved to. A record of an earlier run of the same preset (`record_file`) pins the
    commit; the new record is written by `write_record` once the run directory is the run's."""
    recorded = _read(record_file)
    resolved, out = dict(model), {}
    for key in MODEL_KEYS:
        value = model.get(key)
        ref = hub_reference(value) if value is not None else None
        if ref is None:
            continue
        repo_id, revision = ref
        pinned = recorded.get(key)
        same = pinned is not None and (pinned.id, pinned.revision) == (repo_id, revision)
        hub = _resolve(f"model.{key}", repo_id, revision, commit=pinned.commit if same else None)
        resolved[key], out[key] = Path(hub.path), hub
    return resolved, out


def write_record(record_file: Path, models: dict[str, HubModel]) -> None:
    """runs/<run>/hub.json: what the run's Hub ids resolved to (nothing when it names none)."""
    if models:
        data = {f"model.{key}": asdict(hub) for key, hub in models.items()}
        write_if_changed(record_file, (json.dumps(data, indent=2) + "\n").encode())


def _resolve(key: str, repo_id: str, revision: str, commit: str | None) -> HubModel:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        folder = Path(snapshot_download(repo_id, revision=commit or revision))
    except LocalEntryNotFoundError:
        raise UserError(f"{key}: {repo_id} is neither a directory here nor in the Hugging Face cache, and the Hub "
                        "cannot be reached (offline: HF_HUB_OFFLINE, or no network): give a checkpoint directory "
                        "(`rlpipe model import FILE.gguf DIR` makes one from a GGUF file), or download the model where the Hub is reachable (`hf download` fills the same cache)") from None
    except RevisionNotFoundError:
        raise UserError(f"{key}: the model {repo_id} on the Hugging Face Hub has no revision {commit or revision!r}: "
                        "give a branch, tag or commit it has") from None
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise UserError(f"{key}: {repo_id} is neither a directory here nor a model on the Hugging Face Hub that "
                        f"this machine may read ({type(e).__name__}): give a checkpoint directory, or an org/name "
                        "id (logged in with `hf auth login` for a gated or private one)") from None
    return HubModel(repo_id, revision, folder.name, str(folder))


def _read(record_file: Path) -> dict[str, HubModel]:
    try:
        data = json.loads(record_file.read_text())
    except (OSError, ValueError):
        return {}
    return {key.removeprefix("model."): HubModel(**entry) for key, entry in data.items()}
