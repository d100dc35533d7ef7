"""The registered artifact schemas, by name: what a manifest's `schema_name` (or a `schema=` given
as a string) is looked up in. Re-exported as `rlpipe.schemas.SCHEMAS`."""

from __future__ import annotations

from rlpipe.schemas.advantages import ADVANTAGES
from rlpipe.schemas.columns import ArtifactSchema
from rlpipe.schemas.metrics import METRICS
from rlpipe.schemas.preferences import PREFERENCES
from rlpipe.schemas.prompts import PROMPTS
from rlpipe.schemas.reference import REFERENCE
from rlpipe.schemas.rollouts import ROLLOUTS
from rlpipe.schemas.scores import SCORES

SCHEMAS: dict[str, ArtifactSchema] = {
    s.name: s for s in (PROMPTS, PREFERENCES, ROLLOUTS, SCORES, REFERENCE, ADVANTAGES, METRICS)
}
