"""Config of the filter stage (dynamic sampling; no heavy imports)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from rlpipe.schemas.config import (
    Assigned,
    ImportRef,
    Input,
    Output,
    StageConfig,
    Variant,
    name_shorthand,
)


# ---------------------------------------------------------------------------------------------
# Group predicates: one variant per predicate, each registered with its function in predicates.py
# (`@register_predicate(<variant>)`; a test keeps the tags equal to the registry's names).
# A predicate is true for a group to DROP.
# ---------------------------------------------------------------------------------------------
class AllEqualPredicate(Variant):
    """Drop a group whose sampled rewards are all equal (or that has one sample): every
    group-relative advantage of it is 0, so it only dilutes the batch (DAPO, Yu et al. 2025)."""

    name: Literal["all_equal"] = "all_equal"
    """Predicate name."""


class CustomPredicate(Variant):
    """A user predicate `fn(rewards, **kwargs) -> bool`, imported from `function`: `rewards` is the
    list of a group's sampled rewards (floats, in sample order; a greedy baseline row is not
    among them); True drops the group. Anything but a bool stops the stage with an error naming
    `function`."""

    name: Literal["custom"] = "custom"
    """Predicate name."""
    function: ImportRef
    """Import path 'package.module:function' of the predicate (importable where the stage runs)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed on every call (JSON-able; recorded in the artifact)."""


PredicateConfig = Annotated[
    AllEqualPredicate | CustomPredicate,
    Field(discriminator="name"),
    BeforeValidator(name_shorthand),
]
"""A group predicate and its knobs: `{name: custom, function: ...}`, or just its name (`all_equal`)."""


class FilterConfig(StageConfig):
    """Dynamic sampling: drop the groups `drop` is true for, keep the first `keep_groups` others.

    Groups are taken in group order ((iteration, group_id) ascending), so the groups kept depend
    on the scores alone. With `keep_groups` set and fewer groups passing, `shortfall` decides:
    'refill' keeps the batch size by also keeping the first dropped groups (in group order),
    'error' stops. The output is a scores artifact (same schema, shards and row order, fewer
    rows); its manifest's `extra` records every dropped group.
    """

    scores: Annotated[Path, Input("scores")]
    """Input scores artifact."""
    output: Annotated[Path, Output("scores")]
    """Output scores artifact: the rows of the groups kept."""
    drop: PredicateConfig = AllEqualPredicate()
    """Group predicate, `{name: ..., <knob>: ...}` or a bare name; name: all_equal, custom (a user
    function). True drops the group."""
    keep_groups: Annotated[int | None, Assigned()] = Field(None, ge=1)
    """Groups to keep: the first that pass (the pipeline passes prompts_per_iteration, and the
    rollout oversamples); None: every group that passes."""
    shortfall: Literal["refill", "error"] = "refill"
    """Fewer than keep_groups groups pass: 'refill' with the first dropped groups in group order
    (the batch keeps its size; with GRPO their advantages are 0), or 'error'."""
