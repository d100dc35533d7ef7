"""Reward components as plug-ins: a registry maps a component `type` to a scorer factory.

A factory takes the component's config and returns a scorer: a function from the rows of one
shard (`Rows`) to one float per row. Every scorer's output is checked (count, finite) by
`run_scorer`, and every failure is a `ScoreError` naming the component, the shard and the row.

Adding a component type: write a config class in config.py (with a new `type` literal) and
`@register("<type>")` a factory here.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlpipe.schemas.errors import UserError
from rlpipe.stages.common.cli import import_function
from rlpipe.stages.score import verifiers as V
from rlpipe.stages.score.contain import contain


@dataclass(frozen=True)
class Rows:
    """The columns of one rollouts shard that scorers read."""

    shard: Path
    prompts: list[str]
    responses: list[str]
    answers: list[str | None]
    lengths: np.ndarray
    """Response lengths in tokens the model sampled (an episode's environment tokens left out), (N,) int."""
    group_ids: list[int]
    sample_indices: list[int]
    metadata: list[dict[str, Any]]
    """Each row's prompt metadata (the prompts artifact's JSON object: test cases, choices, a
    reference solution, ...), {} where the prompt has none: what a verifier needs beyond `answers`."""
    turns: list[list[dict[str, Any]] | None] | None = None
    """Episodes: each row's turns (schemas/rollouts.py), None for a single-turn row."""
    environment_rewards: list[float | None] | None = None
    """Episodes: the reward the environment gave each row (None where it gave none)."""
    response_ids: list[list[int]] | None = None
    """Each row's response token ids (what a TRL reward function gets as `completion_ids`)."""
    chat: bool = False
    """Whether the rollout put the prompts through the chat template (a TRL reward function then
    gets prompts and completions as messages)."""

    @property
    def answers_in(self) -> list[str]:
        """The text a verifier checks: an episode's last model turn, else the response."""
        if self.turns is None:
            return self.responses

        def last_model_turn(turns: list[dict[str, Any]] | None, response: str) -> str:
            said = [t["text"] for t in turns or () if t["role"] == "model"]
            return said[-1] if said else response
        return [last_model_turn(t, r) for t, r in zip(self.turns, self.responses, strict=True)]

    def __len__(self) -> int:
        return len(self.responses)

    def where(self, i: int) -> str:
        return f"row {i} (group_id={self.group_ids[i]}, sample_index={self.sample_indices[i]})"


class ScoreError(UserError, RuntimeError):
    """A component failed or returned bad values; the message names component, shard and row."""

    def __init__(self, component: Any, shard: Path | str | None, where: str, what: str):
        parts = [str(x) for x in (shard, where) if x]  # (a shard-wide problem has no row to name)
        at = ", ".join(parts) + ": " if parts else ""
        super().__init__(f"reward component {component.name!r} ({component.type}): {at}{what}")


Scorer = Callable[[Rows], Sequence[float]]
SCORERS: dict[str, Callable[[Any], Scorer]] = {}


def register(type_name: str) -> Callable[[Callable[[Any], Scorer]], Callable[[Any], Scorer]]:
    """Register a scorer factory for component type `type_name` (twice is an error)."""

    def deco(factory: Callable[[Any], Scorer]) -> Callable[[Any], Scorer]:
        if type_name in SCORERS:
            raise ValueError(f"reward component type {type_name!r} is already registered")
        SCORERS[type_name] = factory
        return factory

    return deco


def build_scorer(component: Any) -> Scorer:
    """The scorer for one component config (dispatch through the registry)."""
    try:
        factory = SCORERS[component.type]
    except KeyError:
        raise ValueError(f"unknown reward component type {component.type!r}; known: {sorted(SCORERS)}") from None
    return factory(component)


def run_scorer(component: Any, scorer: Scorer, rows: Rows) -> np.ndarray:
    """Call `scorer` on `rows`; check one finite float per row (NaN for a row a TRL-style function
    left out, None: `leaves_rows_out`). Returns (N,) float64."""
    values = np.asarray(scorer(rows), dtype=np.float64)
    if values.shape != (len(rows),):
        raise ScoreError(component, rows.shard, "", f"returned {values.size} values for {len(rows)} rows")
    left_out = np.isnan(values) if getattr(scorer, "leaves_rows_out", False) else np.zeros(len(values), bool)
    bad = np.flatnonzero(~np.isfinite(values) & ~left_out)
    if bad.size:
        i = int(bad[0])
        raise ScoreError(component, rows.shard, rows.where(i), f"value {values[i]} is not finite")
    return values


# ---------------------------------------------------------------------------------------------
# Built-in components
# ---------------------------------------------------------------------------------------------
@register("answer_match")
def answer_match_scorer(c: Any) -> Scorer:
    def score(rows: Rows) -> list[float]:
        out = []
        for i, (response, answer) in enumerate(zip(rows.answers_in, rows.answers, strict=True)):
            if answer is None:
                if c.missing_answer == "error":
                    raise ScoreError(c, rows.shard, rows.where(i),
                                     "the rollout has no reference answer (set missing_answer: zero to score it 0)")
                out.append(0.0)
                continue
            try:
                out.append(V.answer_match(response, answer, c.mode, c.pattern, c.rel_tol, c.abs_tol))
            except ValueError as e:
                raise ScoreError(c, rows.shard, rows.where(i), str(e)) from None
        return out

    return score


@register("regex_format")
def regex_format_scorer(c: Any) -> Scorer:
    return lambda rows: [V.regex_format(r, c.pattern, c.match) for r in rows.responses]


@register("overlong")
def overlong_scorer(c: Any) -> Scorer:
    return lambda rows: V.overlong_penalty(rows.lengths, c.max_length, c.buffer)


@register("reward_model")
def reward_model_scorer(c: Any) -> Scorer:
    import torch
    from transformers.utils import logging as hf_logging

    from rlpipe.stages.common.model_loading import compute_dtype
    from rlpipe.stages.common.models import load_model
    from rlpipe.stages.reward_model.modeling import (
        RewardCheckpointError,
        check_reward_checkpoint,
        score_texts,
    )

    try:
        check_reward_checkpoint(c.checkpoint)
    except RewardCheckpointError as e:
        raise ScoreError(c, None, "", str(e)) from None
    hf_logging.disable_progress_bar()  # no per-load "Loading weights" bar
    device = c.device if c.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = compute_dtype(c.dtype)
    if device == "cpu":
        model, tokenizer = load_model(c.checkpoint, "reward", dtype=dtype)
    else:  # a private copy: cached models are shared and stay on the CPU
        model, tokenizer = load_model(c.checkpoint, "reward", cache=False, dtype=dtype)
        model.to(device)

    def score(rows: Rows) -> np.ndarray:
        return score_texts(model, tokenizer, rows.prompts, rows.responses, max_length=c.max_length,
                           batch_size=c.batch_size, max_tokens=c.max_tokens_per_batch, packing=c.packing).numpy()

    return score


def accepts_keyword(fn: Callable[..., Any], name: str, *, through_var_kw: bool = True) -> bool:
    """Whether a user reward function takes keyword `name` (by name, or through **kwargs unless
    `through_var_kw` is false): functions written before a keyword reached the score stage are
    called without it."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return any(p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               or through_var_kw and p.kind is p.VAR_KEYWORD for p in params)


def accepts_metadata(fn: Callable[..., Any]) -> bool:
    """Whether a user reward function takes the rows' `metadata` (by name or through **kwargs)."""
    return accepts_keyword(fn, "metadata")


@register("python")
def python_scorer(c: Any) -> Scorer:
    try:
        fn = import_function(c.function)
    except ValueError as e:
        raise ScoreError(c, None, "", str(e)) from None
    trl = c.style == "trl" or c.style == "auto" and accepts_keyword(fn, "completions", through_var_kw=False)
    call = _trl_call(c, fn) if trl else _rlpipe_call(c, fn)

    def score(rows: Rows) -> list[float]:
        out: list[float] = []
        for a in range(0, len(rows), c.batch_size):
            b = min(a + c.batch_size, len(rows))
            try:
                values = list(call(rows, a, b))
            except ScoreError:
                raise
            except Exception as e:  # a user function: report where, keep the original as cause
                raise ScoreError(c, rows.shard, f"rows {a}..{b - 1}", f"{c.function} raised {type(e).__name__}: {e}") from e
            if len(values) != b - a:
                raise ScoreError(c, rows.shard, f"rows {a}..{b - 1}", f"{c.function} returned {len(values)} values for {b - a} rows")
            for j, v in enumerate(values):
                if v is None and trl:  # TRL's "does not apply to this row": no value (adds 0 to the total)
                    out.append(math.nan)
                    continue
                try:
                    x = float(v)
                except (TypeError, ValueError):
                    raise ScoreError(c, rows.shard, rows.where(a + j), f"{c.function} returned {v!r}, not a number") from None
                if not math.isfinite(x):
                    raise ScoreError(c, rows.shard, rows.where(a + j), f"{c.function} returned {x}")
                out.append(x)
        return out

    score.leaves_rows_out = trl  # type: ignore[attr-defined]  (run_scorer: NaN marks a row left out)
    return score


def _rlpipe_call(c: Any, fn: Callable[..., Any]) -> Callable[[Rows, int, int], Any]:
    """Rows a..b as rlpipe calls a reward function: `fn(prompts, responses, answers, **kwargs)`,
    plus the rows' `metadata` for a function that takes it and an episode's `turns` for one that
    names them."""
    with_metadata = accepts_metadata(fn)
    # An episode's turns go only to a function that names `turns` (not through **kwargs).
    with_turns = accepts_keyword(fn, "turns", through_var_kw=False)
    for name, given in (("metadata", with_metadata), ("turns", with_turns)):
        if given and name in c.kwargs:
            raise ScoreError(c, None, "", f"{c.function} takes the rows' `{name}`; kwargs may not set it too")
    contained = contain(fn, ref=c.function, timeout_s=c.timeout_s, isolate=c.isolate)

    def call(rows: Rows, a: int, b: int) -> Any:
        extra = {"metadata": list(rows.metadata[a:b])} if with_metadata else {}
        if with_turns:
            extra["turns"] = list(rows.turns[a:b]) if rows.turns is not None else [None] * (b - a)
        return contained(rows.prompts[a:b], rows.responses[a:b], rows.answers[a:b], **c.kwargs, **extra)
    return call


#: What a TRL reward function gets besides the rows' dataset columns.
_TRL_ARGUMENTS = ("prompts", "completions", "completion_ids")


def _named(fn: Callable[..., Any]) -> set[str]:
    """The parameters `fn` requires by name (no default; not *args / **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty}


def _trl_call(c: Any, fn: Callable[..., Any]) -> Callable[[Rows, int, int], Any]:
    """Rows a..b as TRL's GRPOTrainer calls a reward function: every argument by keyword; prompts
    and completions as text, or as messages where the rollout used the chat template (TRL's
    conversational format); `completion_ids`; each dataset column as its own keyword (the
    prompts' `answer` and every key of their metadata, None where a row lacks it; a column the
    function names is given even where no row of the shard has it, as a data set's column is)."""
    wanted = _named(fn) - set(_TRL_ARGUMENTS) - set(c.kwargs)
    contained = contain(fn, ref=c.function, timeout_s=c.timeout_s, isolate=c.isolate)

    def call(rows: Rows, a: int, b: int) -> Any:
        prompts, completions = list(rows.prompts[a:b]), list(rows.responses[a:b])
        if rows.chat:
            prompts = [[{"role": "user", "content": p}] for p in prompts]
            completions = [[{"role": "assistant", "content": r}] for r in completions]
        columns: dict[str, list[Any]] = {"answer": list(rows.answers[a:b])}
        for key in sorted({k for m in rows.metadata for k in m} | (wanted - set(columns))):  # (a batch may lack one)
            columns[key] = [m.get(key) for m in rows.metadata[a:b]]
        clash = sorted((set(_TRL_ARGUMENTS) | set(c.kwargs)) & set(columns))
        if clash:
            raise ScoreError(c, rows.shard, "", f"the prompts' metadata key(s) {clash} would be given twice to "
                             f"{c.function}: rename them in the data, or leave them out of kwargs")
        ids = rows.response_ids[a:b] if rows.response_ids is not None else [None] * (b - a)
        return contained(prompts=prompts, completions=completions, completion_ids=list(ids), **columns, **c.kwargs)
    return call


@register("environment")
def environment_scorer(c: Any) -> Scorer:
    """The reward the rollout's environment gave each episode (0.0 where it gave none)."""

    def score(rows: Rows) -> list[float]:
        if rows.environment_rewards is None:
            raise ScoreError(c, rows.shard, "", "the rollouts are not episodes (no environment_reward): an "
                             "`environment` component needs rollouts made with rollout.environment")
        return [0.0 if r is None else r for r in rows.environment_rewards]

    return score
