"""The preferences stage: write the preference pairs of the config as an artifact (manifest
last); a rerun with the same config and input finds it complete and writes nothing."""

from __future__ import annotations

from rlpipe.schemas import (
    PREFERENCES,
    Manifest,
    cache_key,
    cached_manifest,
    read_manifest,
    write_table_artifact,
)
from rlpipe.stages.preferences import synthetic
from rlpipe.stages.preferences.config import PreferencesConfig

STAGE = "preferences"


def run(config: PreferencesConfig, *, force: bool = False) -> Manifest:
    """Build the pairs and write them; a cache hit returns the existing manifest."""
    inputs = {"prompts": read_manifest(config.prompts).as_input(config.prompts)} if config.prompts else {}
    key = cache_key(STAGE, config.resolved(), {r: i.content_hash for r, i in inputs.items()})
    if not force and (cached := cached_manifest(config.output, key)) is not None:
        return cached
    if config.kind == "answers":
        table = synthetic.answer_preferences(config.prompts, seed=config.seed)
    else:
        table = synthetic.synthetic_preferences(config.pairs, kind=config.kind, seed=config.seed)
    return write_table_artifact(config.output, PREFERENCES, table, stage=STAGE, config=config.resolved(),
                                inputs=inputs, cache_key=key)
