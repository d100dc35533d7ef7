"""`scores`: the reward of every rollout, total and per component.

R = sum_k w_k * r_k (docs/algorithms.md#rewards). Each component r_k (unweighted) is stored in its own
`reward__<component>` column; `reward` holds the weighted total.
"""

import pyarrow as pa

from rlpipe.schemas.columns import ArtifactSchema, Column, ColumnFamily
from rlpipe.schemas.rollouts import AS_IN_ROLLOUTS, ROLLOUTS

SCORES = ArtifactSchema(
    name="scores",
    version=2,
    doc="Rewards of rollouts: one row per rollout row, same keys.",
    columns=(
        *(AS_IN_ROLLOUTS[c] for c in ("run", "iteration", "prompt_id", "group_id", "sample_index")),
        Column("response_length", pa.int32(), "Token positions T_i of the response: the length of the rollouts' "
               "response_token_ids, an episode's environment tokens included, so that per-token columns "
               "(advantages, reference) align with it. Not a length metric: see sampled_tokens."),
        AS_IN_ROLLOUTS["finish_reason"],
        Column("reward", pa.float32(), "Total sequence reward R = sum_k w_k * r_k."),
        Column("sampled_tokens", pa.int32(), "Tokens the model sampled (rlpipe.schemas.rollouts.sampled_lengths): "
               "response_length for a single-turn response, an episode's model turns only (response_mask 1). "
               "What every length metric and length penalty counts. Null in version-1 shards.",
               nullable=True, since=2),
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
