"""`reference`: per-token forward passes needed before advantages (reference log-probs, values).

Alignment: both lists have the same length as the rollout's `response_token_ids`.
Shards: one per rollouts shard, same index and row order. Written by the `reference` step
(`rlpipe.stages.reference`).
"""

import pyarrow as pa

from rlpipe.schemas.columns import LOGPROBS, ArtifactSchema, Column
from rlpipe.schemas.rollouts import ROLLOUTS

REFERENCE = ArtifactSchema(
    name="reference",
    version=1,
    doc="Per-token reference-model log-probs and critic values of rollouts; same keys as rollouts.",
    columns=(
        Column("run", pa.string(), "Run name, as in rollouts."),
        Column("iteration", pa.int32(), "Iteration, as in rollouts."),
        Column("group_id", pa.int64(), "group_id, as in rollouts."),
        Column("sample_index", pa.int32(), "sample_index, as in rollouts."),
        Column(
            "ref_logprobs",
            LOGPROBS,
            "log pi_ref(token_t | prefix) under the frozen reference model (the shared teacher-forced "
            "forward pass); null if not computed.",
            nullable=True,
        ),
        Column(
            "values",
            LOGPROBS,
            "Critic value V_t of the prefix before response token t (value head at position "
            "P + t - 1); null if no critic.",
            nullable=True,
        ),
    ),
    key=ROLLOUTS.key,
)
