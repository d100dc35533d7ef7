"""Mapping a source's columns onto the `prompts` / `preferences` schemas, with the checks that
make a bad row an error naming the file, the column and the rows.

TRL's dataset types are taken as they are (https://huggingface.co/docs/trl/dataset_formats),
standard (text) or conversational (lists of {role, content} turns):
- prompt-only: `prompt` (a chat when it holds turns: the prompt's messages, rendered by the
  rollout through the model's chat template);
- prompt-completion: `completion` is the reference answer (SFT trains on it) unless the source has
  an `answer` column; a conversational completion is its one assistant turn;
- preference: `prompt`, `chosen`, `rejected`; conversational ones hold turns, of which the prompt's
  last user turn is the pair's prompt text and each response's one assistant turn its text (the
  texts a reward model is trained on and scores rollouts with); implicit prompt (no `prompt`
  column): the pair's shared beginning is its prompt, as TRL's `extract_prompt` cuts it.

Ids: a source without an id column gets ids generated from each row's content (`content_id`): a
hash of the imported row, not its row number, so a prompt keeps its id when rows are added,
removed or reordered (its rollouts, scores and evaluations stay comparable across versions of
the file). A row repeated in the file (RL data sets repeat prompts, and TRL trains on each
repeat) is kept as its own row: its k-th repeat gets the id `<hash>-<k>`, the same on every import
of that file. Ids the file gives itself must be unique.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from rlpipe.schemas.prompts import duplicate_ids, duplicates_text, empty_prompts
from rlpipe.stages.import_data.config import ImportDataConfig
from rlpipe.stages.import_data.sources import DataImportError, Source, not_utf8

#: Default column names, tried in order when the config names none.
DEFAULTS = {
    "prompt": ("prompt",), "messages": ("messages",), "answer": ("answer", "completion"),
    "chosen": ("chosen",), "rejected": ("rejected",), "margin": ("margin",),
}
ID_DEFAULTS = {"prompts": ("prompt_id", "id"), "preferences": ("pair_id", "id")}


def content_id(row: dict[str, Any]) -> str:
    """16 hex digits of sha256 over the row's canonical JSON (sorted keys, id excluded)."""
    text = json.dumps(row, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def mapping(config: ImportDataConfig, source: Source) -> dict[str, str | None]:
    """Schema role -> source column (None: absent), from the config or the default names."""
    roles = ("prompt", "messages", "answer") if config.kind == "prompts" else ("prompt", "chosen", "rejected", "margin")
    out: dict[str, str | None] = {}
    for role in (*roles, "id"):
        named = getattr(config, role)
        if named is not None:
            if named not in source.columns:
                raise DataImportError(f"{source.path}: no column {named!r} (given as {role}); "
                                      f"columns: {', '.join(source.columns)}")
            out[role] = named
        else:
            defaults = ID_DEFAULTS[config.kind] if role == "id" else DEFAULTS[role]
            out[role] = next((c for c in defaults if c in source.columns), None)
    # (preferences without a prompt column: TRL's implicit prompt, the pair's shared beginning)
    needed = [("prompt", "messages")] if config.kind == "prompts" else [("chosen",), ("rejected",)]
    for options in needed:
        if all(out.get(r) is None for r in options):
            flags = " or ".join(f"--{r} COL" for r in options)
            raise DataImportError(f"{source.path}: no {' or '.join(repr(r) for r in options)} column; columns: "
                                  f"{', '.join(source.columns)}: name one with {flags}")
    return out


class _Checker:
    """Collects the rows where a column fails one check, then raises one error for them."""

    def __init__(self, source: Source):
        self.source = source

    def column(self, col: str, values: list[Any], bad: Callable[[Any], bool], what: str) -> None:
        rows = [i for i, v in enumerate(values) if bad(v)]
        if rows:
            raise DataImportError(f"{self.source.path}: column {col!r} {what} at {self.source.where(rows)}")


def _scalar_text(v: Any) -> str | None:
    """Answers and ids as text: strings as they are, numbers and booleans written out."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, bool | int | float):
        return json.dumps(v)
    return json.dumps(v, sort_keys=True, ensure_ascii=False)


def _messages(v: Any) -> list[dict[str, str]] | None | str:
    """Chat turns from a list of {role, content} or its JSON text; a str describing the problem
    when the value is neither."""
    if v is None:
        return None
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            return "is not a JSON list of turns"
    if not isinstance(v, list) or not v:
        return "is not a non-empty list of turns"
    for t in v:
        if not isinstance(t, dict) or not isinstance(t.get("role"), str) or not isinstance(t.get("content"), str):
            return "has a turn without a text 'role' and 'content'"
    return [{"role": t["role"], "content": t["content"]} for t in v]


class Problem(str):
    """Why a value cannot be imported (said with its column and rows)."""


def _answer(v: Any) -> str | None | Problem:
    """A reference answer as text: a conversational completion (TRL) is its one assistant turn."""
    if isinstance(v, list):
        turns = _messages(v)
        if isinstance(turns, str) or len(turns) != 1 or turns[0]["role"] != "assistant":
            return Problem("is not one assistant turn")
        return turns[0]["content"]
    return _scalar_text(v)


def _pair(prompt: Any, chosen: Any, rejected: Any) -> tuple[str, str, str] | Problem:
    """(prompt, chosen, rejected) texts of a preference row in any of TRL's forms: standard or
    conversational, explicit or implicit prompt (None: the pair's shared beginning)."""
    if isinstance(chosen, list) or isinstance(rejected, list) or isinstance(prompt, list):
        turns = [_messages(v) if v is not None else [] for v in (prompt, chosen, rejected)]
        if any(isinstance(t, str) for t in turns):
            return Problem("hold something that is not a list of {role, content} turns")
        context, good, bad = turns
        if prompt is None:  # implicit: the turns both conversations begin with
            shared = 0
            while shared < min(len(good), len(bad)) and good[shared] == bad[shared]:
                shared += 1
            context, good, bad = good[:shared], good[shared:], bad[shared:]
        users = [t["content"] for t in context if t["role"] == "user"]
        if not users:
            return Problem("have no user turn before the responses (nothing to ask)")
        if any(len(t) != 1 or t[0]["role"] != "assistant" for t in (good, bad)):
            return Problem("do not end in one assistant turn each (the chosen and the rejected response)")
        return users[-1], good[0]["content"], bad[0]["content"]
    if not all(isinstance(v, str) for v in (chosen, rejected)) or (prompt is not None and not isinstance(prompt, str)):
        return Problem("are missing or not text")
    if prompt is None:  # TRL's extract_prompt: up to the first difference, a space before it included
        cut = next((i for i, (a, b) in enumerate(zip(chosen, rejected, strict=False)) if a != b), min(len(chosen), len(rejected)))
        if cut > 0 and chosen[cut - 1] == " ":
            cut -= 1
        return chosen[:cut], chosen[cut:], rejected[cut:]
    return prompt, chosen, rejected


def _metadata(row: dict[str, Any], extra: list[str]) -> str | None:
    """The row's unmapped columns as one JSON object; a 'metadata' column holding an object (or
    its JSON text) is merged in at the top level."""
    out: dict[str, Any] = {}
    for col in extra:
        if col not in row:  # a JSON line without this key: nothing to record
            continue
        value = row[col]
        if col == "metadata" and isinstance(value, str):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError:
                parsed = None
            value = parsed if isinstance(parsed, dict) else value
        if col == "metadata" and isinstance(value, dict):
            out.update(value)
        else:
            out[col] = value
    return json.dumps(out, ensure_ascii=False, default=str) if out else None


def build_table(config: ImportDataConfig, source: Source) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """The artifact's columns from the source rows, checked; and a summary for the manifest."""
    cols = mapping(config, source)
    check = _Checker(source)
    rows = source.rows
    mapped = {c for c in cols.values() if c is not None}
    for col in source.columns:
        check.column(col, [r.get(col) for r in rows], not_utf8,
                     "holds text that is not UTF-8 (re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8`)")

    def take(role: str) -> list[Any]:
        return [r.get(cols[role]) for r in rows] if cols[role] is not None else [None] * len(rows)

    if config.kind == "prompts":
        if cols["messages"] is None and cols["prompt"] is not None and any(
                isinstance(r.get(cols["prompt"]), list) for r in rows):  # TRL's conversational prompt
            cols["messages"], cols["prompt"] = cols["prompt"], None
        messages_raw = take("messages")
        if cols["messages"] is not None:
            check.column(cols["messages"], messages_raw, lambda v: isinstance(_messages(v), str),
                         "is not a list of {role, content} turns (or its JSON text)")
        messages = [_messages(v) for v in messages_raw]
        prompts = take("prompt")
        if cols["prompt"] is not None:
            check.column(cols["prompt"], prompts, lambda v: v is not None and not isinstance(v, str), "holds non-text values (a chat? name it with --messages)")
        else:  # the prompt text of a chat: its last user turn, for display and verifiers
            prompts = [next((t["content"] for t in reversed(m) if t["role"] == "user"), m[-1]["content"]) if m else None
                       for m in messages]
        empty = empty_prompts(prompts, messages)
        if empty:
            where = cols["prompt"] if cols["prompt"] is not None else cols["messages"]
            raise DataImportError(f"{source.path}: column {where!r} is empty (nothing to ask) at "
                                  f"{source.where(empty)}: remove those rows or fill them in")
        extra = [c for c in source.columns if c not in mapped]
        answers = take("answer")
        if cols["answer"] is not None:
            check.column(cols["answer"], answers, lambda v: isinstance(_answer(v), Problem),
                         "holds chat turns that are not one assistant turn (a conversational completion is one)")
        table = {"prompt": [p or "" for p in prompts], "answer": [_answer(a) for a in answers],
                 "metadata": [_metadata(r, extra) for r in rows], "messages": messages}
        id_name = "prompt_id"
    else:
        extra = [c for c in source.columns if c not in mapped]
        pairs = [_pair(p, c, r) for p, c, r in zip(take("prompt"), take("chosen"), take("rejected"), strict=True)]
        bad = [i for i, pair in enumerate(pairs) if isinstance(pair, Problem)]
        if bad:
            named = ", ".join(repr(cols[r]) for r in ("prompt", "chosen", "rejected") if cols[r] is not None)
            raise DataImportError(f"{source.path}: columns {named} {pairs[bad[0]]} at {source.where(bad)}")
        prompts = [pair[0] for pair in pairs]
        check.column(cols["prompt"] or cols["chosen"], prompts, lambda v: not v.strip(),
                     "is empty (nothing to ask)" if cols["prompt"] else "share no beginning (no implicit prompt)")
        margins = take("margin")
        if cols["margin"] is not None:
            check.column(cols["margin"], margins, lambda v: v not in (None, "") and not _finite(v),
                         "is not a finite number")
        table = {"prompt": prompts, "chosen": [pair[1] for pair in pairs], "rejected": [pair[2] for pair in pairs],
                 "margin": [float(m) if m not in (None, "") else None for m in margins]}
        id_name = "pair_id"

    if cols["id"] is not None:
        ids = [_scalar_text(v) for v in take("id")]
        check.column(cols["id"], ids, lambda v: v is None or v == "", "has no id")
        dups = duplicate_ids(ids)
        if dups:
            raise DataImportError(f"{source.path}: column {cols['id']!r} repeats ids: {_dups_at(source, dups)}: "
                                  f"every {id_name} must be unique: remove the repeats or fix the ids")
    else:
        ids = _numbered_repeats([content_id({k: v[i] for k, v in table.items()}) for i in range(len(rows))])
    summary = {"source_format": source.format, "columns": {k: v for k, v in cols.items() if v is not None},
               "ids": f"column {cols['id']!r}" if cols["id"] is not None else "generated from row content (sha256)",
               ("metadata_columns" if config.kind == "prompts" else "ignored_columns"): extra}
    return {id_name: ids, **table}, summary


def _numbered_repeats(ids: list[str]) -> list[str]:
    """Content ids with each repeat of an id numbered in file order: a, a-1, a-2, ..."""
    seen: Counter[str] = Counter()
    out = []
    for i in ids:
        out.append(i if not seen[i] else f"{i}-{seen[i]}")
        seen[i] += 1
    return out


def _finite(v: Any) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def _dups_at(source: Source, dups: dict[str, list[int]]) -> str:
    """The repeated ids with the file's own line / row numbers."""
    renumbered = {k: [source.positions[i] for i in v] for k, v in dups.items()}
    return duplicates_text(renumbered, source.unit) + ("" if source.unit == "lines" else " (counted from 0)")
