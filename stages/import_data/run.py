"""The import_data stage: read the source, map and check its columns, write the artifact.

The cache key holds the source's content hash and the mapping, not the source's path: the same
file under another name (or a copy) is not imported twice, and an edited file is.
"""

from __future__ import annotations

import time

from rlpipe.schemas import Manifest, write_table_artifact
from rlpipe.stages.common.stage_io import StageStart, opens
from rlpipe.stages.import_data.config import ImportDataConfig
from rlpipe.stages.import_data.rows import build_table
from rlpipe.stages.import_data.sources import read_source

STAGE = "import_data"


@opens(STAGE)
def run(config: ImportDataConfig, start: StageStart) -> Manifest:
    """Import `config.source` into its output artifact; returns the manifest."""
    source = read_source(config.source, config.split, config.data_files)
    table, summary = build_table(config, source)
    return write_table_artifact(
        config.output, config.kind, table, stage=STAGE, config=config.resolved(),
        inputs=start.inputs, cache_key=start.key, extra=summary, wall_time_s=time.time() - start.started,
    )
