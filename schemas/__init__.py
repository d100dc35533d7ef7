"""rlpipe's contracts: one pyarrow schema per artifact kind, artifact IO and manifests, configs.

Imports only pyarrow, pydantic and PyYAML, so CPU-only workers can read and check artifacts.
"""

from rlpipe.schemas.advantages import ADVANTAGES
from rlpipe.schemas.artifact import (
    ArtifactError,
    ArtifactNotFound,
    ArtifactWriter,
    SchemaMismatch,
    cached_manifest,
    commit_directory,
    exists,
    iter_shards,
    read_manifest,
    read_shard,
    read_table_artifact,
    run_artifacts,
    run_dataset,
    scan_artifact,
    scan_run,
    shard_name,
    split_rows,
    validate_artifact,
    write_table_artifact,
)
from rlpipe.schemas.columns import LOGPROBS, TOKEN_IDS, ArtifactSchema, Column, ColumnFamily
from rlpipe.schemas.config import ConfigError, StageConfig, load_config, parse_config
from rlpipe.schemas.manifest import MANIFEST_NAME, InputRef, Manifest, cache_key
from rlpipe.schemas.metrics import METRICS
from rlpipe.schemas.preferences import PREFERENCES
from rlpipe.schemas.prompts import PROMPTS
from rlpipe.schemas.reference import REFERENCE
from rlpipe.schemas.rollouts import ROLLOUTS
from rlpipe.schemas.scores import SCORES

SCHEMAS: dict[str, ArtifactSchema] = {
    s.name: s for s in (PROMPTS, PREFERENCES, ROLLOUTS, SCORES, REFERENCE, ADVANTAGES, METRICS)
}

__all__ = [
    "ADVANTAGES", "LOGPROBS", "MANIFEST_NAME", "METRICS", "PREFERENCES", "PROMPTS", "REFERENCE",
    "ROLLOUTS", "SCHEMAS", "SCORES", "TOKEN_IDS", "ArtifactError", "ArtifactNotFound",
    "ArtifactSchema", "ArtifactWriter", "Column", "ColumnFamily", "ConfigError", "InputRef",
    "Manifest", "StageConfig", "load_config", "parse_config",
    "SchemaMismatch", "cache_key", "cached_manifest", "commit_directory", "exists", "iter_shards",
    "read_manifest", "read_shard", "read_table_artifact", "run_artifacts", "run_dataset",
    "scan_artifact", "scan_run", "shard_name", "split_rows", "validate_artifact",
    "write_table_artifact",
]
