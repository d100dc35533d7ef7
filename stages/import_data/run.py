"""The import_data stage: read the source, map and check its columns, write the artifact.

The cache key holds the source's content hash and the mapping, not the source's path: the same
file under another name (or a copy) is not imported twice, and an edited file is.
"""

from __future__ import annotations

import time

from rlpipe.schemas import Manifest, cache_key, cached_manifest, write_table_artifact
from rlpipe.schemas.manifest import InputRef
from rlpipe.stages.import_data.config import ImportDataConfig
from rlpipe.stages.import_data.rows import build_table
from rlpipe.stages.import_data.sources import content_hash, read_source

STAGE = "import_data"


def run(config: ImportDataConfig, *, force: bool = False) -> Manifest:
    """Import `config.source` into its output artifact; returns the manifest."""
    started = time.time()
    source_hash = content_hash(config.source) if config.source.exists() else ""
    knobs = {k: v for k, v in config.resolved().items() if k != "source"}
    key = cache_key(STAGE, knobs, {"source": source_hash})
    cached = cached_manifest(config.output, key)
    if cached is not None and not force:
        return cached
    source = read_source(config.source, config.split)
    table, summary = build_table(config, source)
    return write_table_artifact(
        config.output, config.kind, table, stage=STAGE, config=config.resolved(),
        inputs={"source": InputRef(path=str(config.source), content_hash=source_hash)},
        cache_key=key, extra=summary, wall_time_s=time.time() - started,
    )
