"""`preferences`: chosen/rejected response pairs for Bradley-Terry reward-model training."""

import pyarrow as pa

from rlpipe.schemas.columns import ArtifactSchema, Column

PREFERENCES = ArtifactSchema(
    name="preferences",
    version=1,
    doc="Preference pairs: for one prompt, a chosen (better) and a rejected (worse) response.",
    columns=(
        Column("pair_id", pa.string(), "Stable identifier of the pair, unique in the artifact."),
        Column("prompt", pa.string(), "Prompt text shared by both responses."),
        Column("chosen", pa.string(), "The preferred response text (appended to the prompt)."),
        Column("rejected", pa.string(), "The dispreferred response text (appended to the prompt)."),
        Column(
            "margin",
            pa.float32(),
            "Optional per-pair margin m in -log sigmoid(r_c - r_r - m); null means 0.",
            nullable=True,
        ),
    ),
    key=("pair_id",),
)
