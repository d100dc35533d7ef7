"""rlpipe's contracts: one pyarrow schema per artifact kind, artifact IO and manifests, configs.

Imports only pyarrow, pydantic and PyYAML, so CPU-only workers can read and check artifacts.
"""

from rlpipe.schemas.advantages import ADVANTAGES
from rlpipe.schemas.columns import LOGPROBS, TOKEN_IDS, ArtifactSchema, Column, ColumnFamily
from rlpipe.schemas.config import StageConfig
from rlpipe.schemas.config_files import ConfigError, load_config, parse_config
from rlpipe.schemas.errors import ArtifactError, ArtifactNotFound, SchemaMismatch, UserError
from rlpipe.schemas.manifest import MANIFEST_NAME, InputRef, Manifest, cache_key
from rlpipe.schemas.metrics import METRICS
from rlpipe.schemas.preferences import PREFERENCES
from rlpipe.schemas.prompts import PROMPTS
from rlpipe.schemas.reading import cached_manifest, exists, read_manifest
from rlpipe.schemas.reference import REFERENCE
from rlpipe.schemas.registry import SCHEMAS
from rlpipe.schemas.rollouts import ROLLOUTS
from rlpipe.schemas.runs import (
    INITIAL_EVAL_DIR,
    iteration_dir_name,
    iteration_dirs,
    iteration_index,
    run_artifacts,
    run_dataset,
    scan_run,
)
from rlpipe.schemas.scores import SCORES
from rlpipe.schemas.shards import read_shard, shard_name
from rlpipe.schemas.tables import iter_shards, read_table_artifact, scan_artifact, validate_artifact
from rlpipe.schemas.writer import ArtifactWriter, commit_directory, split_rows, write_table_artifact

__all__ = [
    "ADVANTAGES", "INITIAL_EVAL_DIR", "LOGPROBS", "MANIFEST_NAME", "METRICS", "PREFERENCES",
    "PROMPTS", "REFERENCE", "ROLLOUTS", "SCHEMAS", "SCORES", "TOKEN_IDS", "ArtifactError", "ArtifactNotFound",
    "ArtifactSchema", "ArtifactWriter", "Column", "ColumnFamily", "ConfigError", "InputRef",
    "Manifest", "StageConfig", "load_config", "parse_config",
    "SchemaMismatch", "UserError", "cache_key", "cached_manifest", "commit_directory", "exists", "iter_shards",
    "iteration_dir_name", "iteration_dirs", "iteration_index",
    "read_manifest", "read_shard", "read_table_artifact", "run_artifacts", "run_dataset",
    "scan_artifact", "scan_run", "shard_name", "split_rows", "validate_artifact",
    "write_table_artifact",
]
