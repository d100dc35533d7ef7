"""SFT examples through the tokenizer's chat template, laid out token for token as an episode.

A chat model is trained on what it will sample in an episode (stages/rollout/environments/
episode.py, `ChatTurns`): the opening (system prompt, the user's turn, the generation prompt) as
the template renders it; each turn of the model as its text's tokens followed by the token its
generation stops on (the tokenizer's EOS: ChatML's `<|im_end|>`, the template's own end-of-turn);
after a turn that calls a tool, the rest of the template's closing (`ChatTurns.reply`: all of it
where the EOS is not where the template's closing starts), the tool's reply as the template
renders a `tool` turn, and the next generation prompt. The targets are the model's turns and their
EOS; everything the template or the environment writes is input only, exactly the episode's mask.
So a model warm-started here calls tools in the very token layout GRPO then trains it on (TRL's
SFT calls the same thing `assistant_only_loss`).

An answer is given as the task stage writes a tool-use trace (`calculator_trace`: the call, the
tool's reply block, the answer; `core.answer_segments` cuts it): each trained segment is one model
turn, each reply block the tool turn after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from rlpipe.stages.rollout.environments.episode import ChatTurns
from rlpipe.stages.rollout.environments.tools import parse_tool_calls, tool_response_text
from rlpipe.stages.sft.core import Example


def chat_example(turns: ChatTurns, opening: list[dict[str, Any]], segments: Sequence[tuple[str, bool]],
                 tokenize: Any, max_length: int, loss_on: Literal["answer", "all"] = "answer") -> Example:
    """One example: `opening` (the prompt's messages) through the template, untrained (with
    `loss_on` 'all': every token of it but the first), then the answer's `segments` (text,
    is-the-model's) as model turns and tool turns (see the module doc); what the template writes
    after a model turn and the tools' turns are never targets. Truncated to `max_length` tokens
    from the right."""
    ids = turns.opening(opening)
    target = [i > 0 and loss_on == "all" for i in range(len(ids))]
    end_of_turn = [turns.tokenizer.eos_token_id]  # what generation stops on: ChatML's '<|im_end|>'
    previous: list[int] | None = None  # the last model turn's ids, whose closing a reply completes
    previous_text = ""
    for text, is_model in segments:
        if is_model:
            sampled = [*tokenize(text), *end_of_turn]
            ids += sampled
            target += [True] * len(sampled)
            previous, previous_text = sampled, text
            continue
        if previous is None:
            raise ValueError(f"a tool's reply ({text.strip()[:60]!r}) before any turn of the model")
        reply = turns.reply(_tool_messages(previous_text, text), previous)
        ids += reply
        target += [False] * len(reply)
        previous = None
    return Example(ids[:max_length], target[:max_length])


def _tool_messages(call_text: str, reply_block: str) -> list[dict[str, Any]]:
    """The `tool` turn of a trace's reply block (`tool_response_text` around the result), named
    after the call the model turn before it made, as the tools environment replies."""
    opening, closing = tool_response_text("\0").split("\0")
    content = reply_block.strip("\n")
    content = content.removeprefix(opening).removesuffix(closing)
    calls = parse_tool_calls(call_text)
    name = calls[0].name if calls else ""
    return [{"role": "tool", "name": name, "content": content}]
