"""User reward functions for the score tests (imported by path `user_rewards:<name>`)."""

import math


def length_bonus(prompts, responses, answers, scale=1.0):
    return [scale * len(r) for r in responses]


def raises(prompts, responses, answers):
    raise ZeroDivisionError("boom")


def returns_nan_at_3(prompts, responses, answers):
    return [math.nan if i == 3 else 0.0 for i in range(len(responses))]


def returns_too_few(prompts, responses, answers):
    return [0.0] * (len(responses) - 1)


def nan_for_prompt(prompts, responses, answers, prompt):
    return [math.nan if p == prompt else 1.0 for p in prompts]


def metadata_points(prompts, responses, answers, metadata):
    """A verifier that needs more than the answer: each prompt's own points from its metadata,
    checked against the prompt text it was stored with (-100: the row got another prompt's)."""
    return [m["points"] if m.get("prompt") == p else -100.0 if m else 0.0 for p, m in zip(prompts, metadata, strict=True)]


def metadata_through_kwargs(prompts, responses, answers, **kwargs):
    return [len(m) for m in kwargs["metadata"]]


def tool_calls_made(prompts, responses, answers, turns):
    """Episodes: the number of tool calls in the row's turns (single-turn rows: -1)."""
    return [-1.0 if t is None else float(sum(len(x["tool_calls"]) for x in t)) for t in turns]


# -- reward functions written for TRL's GRPOTrainer, as its documentation writes them ----------
def _text(completion):
    return completion[0]["content"] if isinstance(completion, list) else completion


def trl_format_reward(completions, **kwargs):
    """1.0 where the completion is a number alone."""
    import re

    return [1.0 if re.fullmatch(r"\s*-?\d+\s*", _text(c)) else 0.0 for c in completions]


def trl_accuracy_reward(completions, answer, **kwargs):
    """A dataset column (`answer`) as its own keyword; None where the row has no answer."""
    return [None if a is None else float(_text(c).strip() == a) for c, a in zip(completions, answer, strict=True)]


def trl_level_bonus(prompts, completions, completion_ids, level, **kwargs):
    """A metadata key as its own keyword, and the completion's token ids."""
    return [None if lv is None else 0.1 * lv + 0.001 * len(ids) for lv, ids in zip(level, completion_ids, strict=True)]


def trl_sees(prompts, completions, **kwargs):
    """What it was given, as a number: 1 for messages, 0 for text."""
    return [float(isinstance(p, list) and isinstance(c, list) and c[0]["role"] == "assistant"
                  and p[0]["role"] == "user") for p, c in zip(prompts, completions, strict=True)]


def trl_operand_bonus(completions, completion_ids, a, **kwargs):
    """A metadata key of the arithmetic task (its first operand `a`) as its own keyword, and the
    completion's token ids: values that differ from row to row."""
    return [0.1 * x + 0.01 * len(ids) for x, ids in zip(a, completion_ids, strict=True)]
