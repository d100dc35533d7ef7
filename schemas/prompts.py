"""`prompts`: the questions a policy is asked, with optional reference answers."""

import pyarrow as pa

from rlpipe.schemas.columns import ArtifactSchema, Column

PROMPTS = ArtifactSchema(
    name="prompts",
    version=1,
    doc="Prompts to sample responses for; one row per prompt.",
    columns=(
        Column("prompt_id", pa.string(), "Stable identifier of the prompt, unique in the artifact."),
        Column("prompt", pa.string(), "Prompt text, fed to the tokenizer as is (no chat template)."),
        Column(
            "answer",
            pa.string(),
            "Reference answer used by rule-based verifiers; null when the task has none.",
            nullable=True,
        ),
        Column(
            "metadata",
            pa.string(),
            "Free-form JSON object (task name, difficulty, ...); null when absent.",
            nullable=True,
        ),
    ),
    key=("prompt_id",),
)
