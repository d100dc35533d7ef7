"""`reference`: per-token forward passes needed before advantages (reference log-probs, values).

Alignment: both lists have the same length as the rollout's `response_token_ids`. Episodes:
computed on every token, the environment's included (the model reads them either way); the
advantage stage keeps the sampled tokens' only (the rollouts' `response_mask`).
Shards: one per rollouts shard, same index and row order. Written by the `reference` step
(`rlpipe.stages.reference`).
"""


from rlpipe.schemas.columns import LOGPROBS, ArtifactSchema, Column
from rlpipe.schemas.rollouts import AS_IN_ROLLOUTS, ROLLOUTS

REFERENCE = ArtifactSchema(
    name="reference",
    version=1,
    doc="Per-token reference-model log-probs and critic values of rollouts; same keys as rollouts.",
    columns=(
        *(AS_IN_ROLLOUTS[c] for c in ("run", "iteration", "group_id", "sample_index")),
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
