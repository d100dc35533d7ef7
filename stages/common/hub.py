"""Hugging Face Hub ids where a checkpoint directory or a data file is expected: `org/name` or
`org/name@revision`, where no such local path exists, resolved through
`huggingface_hub.snapshot_download` (its cache, `HF_HOME` / `HF_HUB_CACHE`, offline mode
`HF_HUB_OFFLINE=1` and token are the user's, as for any Hugging Face tool) to the snapshot folder
of one commit of a model or dataset repository, which the stages then read like any checkpoint
directory or data folder.

Used by a run for its `model.*` and `data.*` keys (pipelines/hub_models.py: resolved once,
recorded in the run) and by a stage run alone for its inputs (`resolve_hub_inputs`: the snapshot
folder, whose name is the commit, is what its manifest records as the input). An existing local
path always wins over an id that happens to look the same.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlpipe.schemas.errors import UserError
from rlpipe.schemas.inputs import hub_reference

_log = logging.getLogger(__name__)

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


def resolve(key: str, repo_id: str, revision: str, commit: str | None, repo_type: str = "model") -> HubModel:
    """The snapshot of `repo_id` (a model or a dataset repository) at `commit` (else at
    `revision`) in the Hub cache, fetched into it when the Hub is reachable; a UserError naming
    `key` (the knob that gave the id) otherwise."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what, local = ("model", "a checkpoint directory (`rlpipe model import FILE.gguf DIR` makes one from a GGUF "
                            "file)") if repo_type == "model" else ("dataset", "a data file or folder")
    try:
        folder = Path(snapshot_download(repo_id, revision=commit or revision, repo_type=repo_type))
    except LocalEntryNotFoundError:
        raise UserError(f"{key}: {repo_id} is neither a {'directory' if repo_type == 'model' else 'path'} here nor "
                        "in the Hugging Face cache, and the Hub cannot be reached (offline: HF_HUB_OFFLINE, or no "
                        f"network): give {local}, or download the {what} where the Hub is reachable (`hf download"
                        f"{' --repo-type dataset' if repo_type == 'dataset' else ''}` fills the same cache)") from None
    except RevisionNotFoundError:
        raise UserError(f"{key}: the {what} {repo_id} on the Hugging Face Hub has no revision {commit or revision!r}: "
                        "give a branch, tag or commit it has") from None
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise UserError(f"{key}: {repo_id} is neither a {'directory' if repo_type == 'model' else 'path'} here nor a "
                        f"{what} on the Hugging Face Hub that this machine may read ({type(e).__name__}): give {local}, "
                        "or an org/name id (logged in with `hf auth login` for a gated or private one)") from None
    return HubModel(repo_id, revision, folder.name, str(folder))


def resolve_hub_inputs(config: Any) -> Any:
    """`config` (a stage's) with every checkpoint and data file it reads given as a Hub id (a
    checkpoint input, a reward-model component's `checkpoint`: a model repository; a data file to
    import: a dataset repository) replaced by its snapshot folder, one line logged for each (id,
    revision, commit); the same config when none is."""
    from rlpipe.schemas.config_files import map_paths

    kinds = {name: marker.kind for name, marker in config.input_fields().items()}

    def snapshot(loc: tuple[str | int, ...], value: Path) -> Path:
        kind = kinds.get(str(loc[0])) or ("checkpoint" if loc[0] == "components" and loc[-1] == "checkpoint" else None)
        ref = hub_reference(value) if kind in ("checkpoint", "file") else None
        if ref is None:
            return value
        key = ".".join(str(part) for part in loc)
        hub = resolve(key, *ref, commit=None, repo_type="model" if kind == "checkpoint" else "dataset")
        _log.info(f"{key}: {hub.id} at {hub.revision} is commit {hub.commit} ({hub.path})")
        return Path(hub.path)

    return map_paths(config, snapshot)
