"""`metrics`: one row per optimisation step (or evaluation), long format (name, value)."""

import pyarrow as pa

from rlpipe.schemas.columns import ArtifactSchema, Column

METRICS = ArtifactSchema(
    name="metrics",
    version=1,
    doc="Scalar metrics in long format: one row per (step, name).",
    columns=(
        Column("run", pa.string(), "Run name."),
        Column("iteration", pa.int32(), "Iteration the metric belongs to."),
        Column("stage", pa.string(), "Stage that logged it (optimize, reward_model, evaluate, ...)."),
        Column("step", pa.int32(), "Step within the stage (optimizer step, epoch, ...); 0 for once-per-stage values."),
        Column("name", pa.string(), "Metric name, e.g. 'policy_loss', 'clip_fraction'."),
        Column("value", pa.float64(), "Metric value."),
    ),
    key=("iteration", "stage", "step", "name"),
)
