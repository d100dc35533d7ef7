"""`prompts`: the questions a policy is asked, with optional reference answers.

A prompt is plain text (`prompt`) or a chat (`messages`: a list of {role, content} turns, typed,
so a bad turn is rejected when the artifact is written rather than when the rollout reads it).
The rollout stage applies the tokenizer's chat template to `messages` (or to the plain prompt as
one user turn) when its `chat_template` knob says so; see `rlpipe.stages.rollout.config`.

Contract checks shared by every stage that writes or reads prompts (`duplicate_ids`,
`empty_prompts`) live here, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from rlpipe.schemas.columns import ArtifactSchema, Column

#: One chat turn; `role` is 'system', 'user' or 'assistant' for most chat templates.
MESSAGE = pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())])

PROMPTS = ArtifactSchema(
    name="prompts",
    version=2,
    doc="Prompts to sample responses for; one row per prompt.",
    columns=(
        Column("prompt_id", pa.string(), "Stable identifier of the prompt, unique in the artifact."),
        Column("prompt", pa.string(),
               "Prompt text. With `messages` null it is what the policy is asked (as is, or as one "
               "user turn when the rollout applies a chat template); with `messages` set it is the "
               "last user turn's content, for display, verifiers and reward models."),
        Column(
            "answer",
            pa.string(),
            "Reference answer used by rule-based verifiers; null when the task has none.",
            nullable=True,
        ),
        Column(
            "metadata",
            pa.string(),
            "Free-form JSON object (task name, difficulty, test cases, choices, ...); passed on to "
            "rollouts and to the score stage's verifiers and user reward functions; null when absent.",
            nullable=True,
        ),
        Column(
            "messages",
            pa.list_(MESSAGE),
            "The prompt as chat turns [{role, content}, ...] (system / user / assistant), ending "
            "where the policy answers; the rollout stage applies the tokenizer's chat template to "
            "them. Null: a plain-text prompt (`prompt`).",
            nullable=True,
            since=2,
        ),
    ),
    key=("prompt_id",),
)


def duplicate_ids(ids: Sequence[Any]) -> dict[Any, list[int]]:
    """Each id that occurs more than once -> the 0-based positions where it occurs (in order)."""
    where: dict[Any, list[int]] = {}
    for i, v in enumerate(ids):
        where.setdefault(v, []).append(i)
    return {v: rows for v, rows in where.items() if len(rows) > 1}


def empty_prompts(prompts: Sequence[str | None], messages: Sequence[list[dict] | None]) -> list[int]:
    """0-based positions of prompts with nothing to ask: a null or whitespace-only text and no
    messages, or messages whose turns all have empty content (sampling from them would condition
    the policy on nothing but the template)."""
    out = []
    for i, (text, turns) in enumerate(zip(prompts, messages, strict=True)):
        if turns:
            if not any((t.get("content") or "").strip() for t in turns):
                out.append(i)
        elif not (text or "").strip():
            out.append(i)
    return out


def rows_text(rows: Sequence[int], limit: int = 10) -> str:
    """'3, 7, 12' (at most `limit` numbers, then '... (N in all)'): row lists in error messages."""
    shown = ", ".join(str(r) for r in rows[:limit])
    return shown + (f", ... ({len(rows)} in all)" if len(rows) > limit else "")


def duplicates_text(dups: dict[Any, list[int]], unit: str = "rows", limit: int = 5) -> str:
    """"'a' at rows 1, 4; 'b' at rows 2, 9" for `duplicate_ids` output (positions as given)."""
    parts = [f"{v!r} at {unit} {rows_text(rows)}" for v, rows in list(dups.items())[:limit]]
    more = f"; ... ({len(dups)} ids in all)" if len(dups) > limit else ""
    return "; ".join(parts) + more
