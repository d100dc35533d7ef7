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
