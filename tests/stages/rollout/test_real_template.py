"""Episodes on a real chat template: SmolLM2's own tokenizer and ChatML template, token by token.

A scripted model (`ScriptedTurns`: turn k says the given ids) drives `run_episodes` with
`ChatTurns`, so what is checked is exactly the layout: the episode's prompt and tokens are the
template's rendering of the same messages, the mask is 1 on exactly the sampled tokens, and the
closing after a turn is the template's own ids whether the model sampled its end-of-turn token,
was cut by length (also right after a plain '<', which decodes like the start of '<|im_end|>'), or
stopped on a stop string. `turn_end` is derived so that no template text can fool it.
"""

from __future__ import annotations

import copy

import pytest

from rlpipe.stages.rollout.engines import Sample, SamplingSpec
from rlpipe.stages.rollout.environments import EnvironmentSpec, make_environment
from rlpipe.stages.rollout.environments.episode import ChatTurns, run_episodes, sampled_closing

pytestmark = [pytest.mark.multiturn]

SPEC = SamplingSpec(group_size=1, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=64)
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*23"}}\n</tool_call>'


class ScriptedTurns:
    """Stands in for the model: turn k of every episode is `turns[k]` (ids) with `finish[k]`."""

    name = "scripted"
    context_length = 8192
    start_s = 0.0
    model_load = None

    def __init__(self, tokenizer, turns: list[list[int]], finish: list[str]):
        self.tokenizer, self.turns, self.finish, self.k = tokenizer, turns, finish, 0

    def generate(self, prompts, seeds, params):
        ids, finish = self.turns[self.k], self.finish[self.k]
        self.k += 1
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return [[Sample(list(ids), [-0.25] * len(ids), text, finish) for _ in range(params.group_size)]
                for _ in prompts]


def _text(tok, s: str) -> list[int]:
    return tok(s, add_special_tokens=False)["input_ids"]


def _calculator():
    return make_environment(EnvironmentSpec(name="tools", kwargs={"tools": ["calculator"]}))


def _episode(tok, turns, finish):
    model = ScriptedTurns(tok, turns, finish)
    [[ep]] = run_episodes(model, [{"prompt": "What is 17 * 23?", "messages": None}], [0], SPEC, _calculator(),
                          ChatTurns(tok), max_turns=2)
    return ep


MESSAGES = [{"role": "user", "content": "What is 17 * 23?"},
            {"role": "assistant", "content": CALL},
            {"role": "tool", "content": "391"},
            {"role": "assistant", "content": "17 * 23 = 391"}]


@pytest.mark.real_model
def test_a_tool_episode_is_the_templates_rendering_with_the_mask_on_the_sampled_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id == end  # the model's end-of-turn token is the one it stops on
    call, answer = _text(tok, CALL) + [end], _text(tok, "17 * 23 = 391") + [end]
    ep = _episode(tok, [call, answer], ["stop", "stop"])

    rendered = tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=False)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    # the template closes the last turn with '<|im_end|>\n'; the episode ends on the sampled '<|im_end|>'
    assert ep.prompt_ids + ep.token_ids == rendered[:-1]
    assert tok.decode(ep.prompt_ids).endswith("<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n")
    # mask 1 on exactly the sampled tokens (both end-of-turn tokens included), 0 on the reply
    reply = ep.token_ids[len(call):len(ep.token_ids) - len(answer)]
    assert ep.token_ids == call + reply + answer
    assert ep.mask == [1] * len(call) + [0] * len(reply) + [1] * len(answer)
    assert tok.decode(reply) == "\n<|im_start|>tool\n391<|im_end|>\n<|im_start|>assistant\n"
    assert ep.logprobs == [-0.25] * len(call) + [None] * len(reply) + [-0.25] * len(answer)
    assert ep.turns[1].messages == [{"role": "tool", "name": "calculator", "content": "391"}]


@pytest.mark.real_model
@pytest.mark.parametrize("case", ["stop string", "cut after '<'"])
def test_a_turn_not_ended_by_the_model_gets_the_templates_whole_closing_as_its_ids(smollm2_tokenizer, case):
    tok = smollm2_tokenizer
    end, newline = tok.convert_tokens_to_ids("<|im_end|>"), _text(tok, "\n")
    # stop string: generation stopped at '</tool_call>' (no end-of-turn sampled); cut: max_new_tokens
    # ran out right after a plain '<', whose text is the start of '<|im_end|>' but not its id
    first = _text(tok, CALL) if case == "stop string" else _text(tok, CALL + " <")
    finish = "stop" if case == "stop string" else "length"
    if case != "stop string":
        assert tok.decode(first[-1:]).strip() == "<" and first[-1] != end
    ep = _episode(tok, [first, _text(tok, "391") + [end]], [finish, "stop"])
    reply = ep.token_ids[len(first):ep.turns[1].end]
    assert reply[:2] == [end, *newline]  # the template's '<|im_end|>' and new line, as ids, mask 0
    assert ep.mask[len(first):ep.turns[1].end] == [0] * len(reply)
    assert tok.decode(reply) == "<|im_end|>\n<|im_start|>tool\n391<|im_end|>\n<|im_start|>assistant\n"


def test_sampled_closing_compares_ids():
    closing = [2, 198]
    assert sampled_closing([5, 6, 2], closing) == 1
    assert sampled_closing([5, 2, 198], closing) == 2
    assert sampled_closing([5, 6, 44], closing) == 0  # '<' is not '<|im_end|>'
    assert sampled_closing([], closing) == 0


def test_turn_end_is_what_follows_the_content_whatever_letters_the_template_writes(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)  # (a session fixture)
    # a closing with an 'a' in it (the old derivation took the text after the template's last 'a')
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                         "{% if m['role'] == 'assistant' %} [a turn ends]{% endif %}{{ '\\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert ChatTurns(tok).turn_end == " [a turn ends]\n"


def test_a_template_that_rewrites_the_content_is_refused_with_what_to_do(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | lower }}\n{% endfor %}"
    with pytest.raises(ValueError, match="chat_template: false"):
        ChatTurns(tok)


@pytest.mark.real_model
@pytest.mark.parametrize("system", [None, "You can use a calculator."])
def test_a_chat_sft_example_is_the_episode_of_the_same_turns(smollm2_tokenizer, system):
    """A tool-use trace as an SFT example through the chat template (stages/sft/chat.py) is, token
    for token, the episode in which the model samples the same turns: the same ids, targets on
    exactly the episode's sampled tokens (the '<|im_end|>' ending each turn included), so the
    warm start trains the layout GRPO then samples."""
    from rlpipe.stages.rollout.environments.tools import tool_call_text
    from rlpipe.stages.sft.chat import chat_example
    from rlpipe.stages.sft.core import answer_segments
    from rlpipe.stages.task.arithmetic import calculator_trace

    tok = smollm2_tokenizer
    end = tok.eos_token_id
    call = tool_call_text("calculator", {"expression": "17*23"})
    example = chat_example(ChatTurns(tok, None, system), [{"role": "user", "content": "What is 17 * 23?"}],
                           answer_segments(calculator_trace(17, "*", 23, "391"), True), lambda t: _text(tok, t), 4096)

    model = ScriptedTurns(tok, [_text(tok, call) + [end], _text(tok, "391") + [end]], ["stop", "stop"])
    [[ep]] = run_episodes(model, [{"prompt": "What is 17 * 23?", "messages": None}], [0], SPEC, _calculator(),
                          ChatTurns(tok, None, system), max_turns=2)
    assert example.input_ids == ep.prompt_ids + ep.token_ids
    assert example.target == [False] * len(ep.prompt_ids) + [m == 1 for m in ep.mask]
    assert tok.decode([t for t, keep in zip(example.input_ids, example.target, strict=True) if keep]) == call + "<|im_end|>391<|im_end|>"
    if system is not None:
        assert tok.decode(ep.prompt_ids).startswith(f"<|im_start|>system\n{system}<|im_end|>")
