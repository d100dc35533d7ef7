"""The preferences stage: write the preference pairs of the config as an artifact (manifest
last); a rerun with the same config and input finds it complete and writes nothing."""

from __future__ import annotations

from rlpipe.schemas import (
    PREFERENCES,
    Manifest,
    write_table_artifact,
)
from rlpipe.stages.common.stage_io import StageStart, opens
from rlpipe.stages.preferences import synthetic
from rlpipe.stages.preferences.config import PreferencesConfig

STAGE = "preferences"


@opens(STAGE)
def run(config: PreferencesConfig, start: StageStart) -> Manifest:
    """Build the pairs and write them; a cache hit returns the existing manifest."""
    inputs, key = start.inputs, start.key
    if config.kind == "answers":
        table = synthetic.answer_preferences(config.prompts, wrong=config.wrong, seed=config.seed)
    else:
        table = synthetic.synthetic_preferences(config.pairs, kind=config.kind, seed=config.seed)
    return write_table_artifact(config.output, PREFERENCES, table, stage=STAGE, config=config.resolved(),
                                inputs=inputs, cache_key=key)
