"""`scores`: the reward of every rollout, total and per component.

R = sum_k w_k * r_k (ALGORITHMS.md section 3). Each component r_k (unweighted) is stored in its own
`reward__<component>` column; `reward` holds the weighted total.
"""

import pyarrow as pa

from rlpipe.schemas.columns import ArtifactSchema, Column, ColumnFamily
from rlpipe.schemas.rollouts import ROLLOUTS

SCORES = ArtifactSchema(
    name="scores",
    version=1,
    doc="Rewards of rollouts: one row per rollout row, same keys.",
    columns=(
        Column("run", pa.string(), "Run name, as in rollouts."),
        Column("iteration", pa.int32(), "Iteration, as in rollouts."),
        Column("prompt_id", pa.string(), "prompt_id, as in rollouts."),
        Column("group_id", pa.int64(), "group_id, as in rollouts."),
        Column("sample_index", pa.int32(), "sample_index, as in rollouts."),
        Column("response_length", pa.int32(), "Number of response tokens T_i (for length metrics and shaping)."),
        Column("finish_reason", pa.string(), "finish_reason, as in rollouts."),
        Column("reward", pa.float32(), "Total sequence reward R = sum_k w_k * r_k."),
    ),
    families=(
        ColumnFamily(
            "reward__",
            pa.float32(),
            "Unweighted value r_k of one reward component (the column suffix is the component name).",
        ),
    ),
    key=ROLLOUTS.key,
)
