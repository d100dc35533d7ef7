"""Config of the import_data stage: a data file + a column mapping -> a prompts or preferences artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import model_validator

from rlpipe.schemas.config import Input, Output, StageConfig

#: Column knobs that belong to one kind of import only: kind -> the other kind's knobs.
ONLY_FOR = {"prompts": ("chosen", "rejected", "margin"), "preferences": ("messages", "answer")}


class ImportDataConfig(StageConfig):
    """Import prompts or preference pairs from a JSONL, CSV or Parquet file, or a directory saved
    with `datasets.Dataset.save_to_disk`, into an artifact. Columns are found by their usual names
    (prompt, messages, answer or completion, prompt_id / pair_id / id, chosen, rejected, margin) or
    named here; every other column of a prompt is kept in its `metadata` JSON. TRL's dataset types
    are taken as they are: prompt-only, prompt-completion and preference (explicit or implicit
    prompt), standard or conversational (stages/import_data/rows.py). Rows with a repeated id, an
    empty prompt or text that is not UTF-8 are refused, with their line / row numbers."""

    source: Annotated[Path, Input("file")]
    """The file to import: .jsonl / .ndjson / .json (JSON Lines, or one JSON array of objects),
    .csv / .tsv (header row first), .parquet, a `datasets` directory (save_to_disk), a folder of
    data files, or a Hugging Face Hub dataset id `org/name[@revision]` (its snapshot, through the
    Hub cache). The stage's cache key holds its content hash, not its path."""
    prompts: Annotated[Path | None, Output("prompts")] = None
    """Output `prompts` artifact (set this or `preferences`)."""
    preferences: Annotated[Path | None, Output("preferences")] = None
    """Output `preferences` artifact (set this or `prompts`)."""
    split: str | None = None
    """A `datasets` directory or a data folder (a Hub dataset) holding several splits: the split to
    import (default: the only one, else 'train')."""
    data_files: str | list[str] | dict[str, str | list[str]] | None = None
    """A data folder or Hub dataset: the files to read, as `datasets.load_dataset` takes them (a
    glob relative to the folder, a list, or {split: pattern}); default: its data files as
    `datasets` finds them (its README's configs, or files named by split)."""
    prompt: str | None = None
    """Column with the prompt text, or its chat turns (TRL's conversational prompt) (default:
    'prompt' when the source has it). Preferences without one: the implicit prompt, the beginning
    chosen and rejected share."""
    messages: str | None = None
    """Prompts only: column with the prompt as chat turns, a list of {role, content} objects or a
    JSON string of one (default: 'messages' when the source has it)."""
    answer: str | None = None
    """Prompts only: column with the reference answer (default: 'answer', else TRL's 'completion',
    when present; a conversational completion is its one assistant turn)."""
    id: str | None = None
    """Column with unique row ids (default: 'prompt_id' / 'pair_id', else 'id', when present).
    Without one, ids are generated from each row's content (see `rows.content_id`)."""
    chosen: str | None = None
    """Preferences only: column with the preferred response (default: 'chosen')."""
    rejected: str | None = None
    """Preferences only: column with the dispreferred response (default: 'rejected')."""
    margin: str | None = None
    """Preferences only: column with an optional per-pair margin (default: 'margin' when present)."""

    @model_validator(mode="after")
    def _one_output(self) -> ImportDataConfig:
        if (self.prompts is None) == (self.preferences is None):
            raise ValueError("set exactly one output: prompts (import prompts) or preferences (import pairs)")
        given = [k for k in ONLY_FOR[self.kind] if getattr(self, k) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} name columns of the other kind of import, not of {self.kind}")
        return self

    @property
    def kind(self) -> str:
        """'prompts' or 'preferences': the schema written."""
        return "prompts" if self.prompts is not None else "preferences"

    @property
    def output(self) -> Path:
        """The artifact written."""
        return self.prompts if self.prompts is not None else self.preferences  # type: ignore[return-value]
