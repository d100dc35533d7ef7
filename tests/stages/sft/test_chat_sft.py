"""The sft stage through a chat template: each example laid out as the episode of the same turns
(stages/sft/chat.py; token for token on SmolLM2's own template: tests/stages/rollout/
test_real_template.py), the loss on the model's turns only."""

from __future__ import annotations

import pytest

from rlpipe.schemas import METRICS, PROMPTS, read_table_artifact, write_table_artifact
from rlpipe.schemas.config_files import ConfigError
from rlpipe.stages.base_model.run import make_base_checkpoint
from rlpipe.stages.common.tiny import load_checkpoint
from rlpipe.stages.rollout.environments.episode import ChatTurns
from rlpipe.stages.sft import core
from rlpipe.stages.sft.chat import chat_example
from rlpipe.stages.sft.config import SFTConfig
from rlpipe.stages.sft.run import run
from rlpipe.stages.task.arithmetic import ArithmeticTask, calculator_trace, tokenizer_texts

TASK = ArithmeticTask(a_range=(10, 99), b_range=(2, 9), ops=("*",))
#: ChatML-like: each turn closed by the tokenizer's EOS and a new line, as SmolLM2's or Qwen's.
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|eos|>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
ROWS = [(a, b) for a, b in ((12, 3), (45, 7), (99, 2), (31, 9), (60, 5), (77, 4))]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_sft")
    make_base_checkpoint(root / "plain", tokenizer_texts(TASK, tools=True), size="tiny", seed=0)
    model, tok = load_checkpoint(root / "plain")
    tok.chat_template = TEMPLATE
    model.save_pretrained(root / "chat")
    tok.save_pretrained(root / "chat")
    write_table_artifact(root / "prompts", PROMPTS, {
        "prompt_id": [f"p{i}" for i in range(len(ROWS))], "prompt": [f"{a}*{b}=" for a, b in ROWS],
        "answer": [calculator_trace(a, "*", b, str(a * b)) for a, b in ROWS],
        "metadata": [None] * len(ROWS), "messages": [None] * len(ROWS)}, stage="test")
    return root, tok


def _targets(root, name):
    rows = read_table_artifact(root / f"{name}_metrics", METRICS).to_pylist()
    return [r["value"] for r in rows if r["name"] == "target_tokens"]


def test_the_stage_trains_on_the_chat_layout_of_each_example(data):
    root, tok = data
    cfg = SFTConfig(base=root / "chat", prompts=root / "prompts", output=root / "sft", max_steps=2, batch_size=3,
                    system_prompt="Use the calculator.", seed=0)
    run(cfg)
    turns = ChatTurns(tok, None, "Use the calculator.")
    examples = [chat_example(turns, [{"role": "user", "content": f"{a}*{b}="}],
                             core.answer_segments(calculator_trace(a, "*", b, str(a * b)), True),
                             lambda t: tok(t, add_special_tokens=False).input_ids, cfg.max_length) for a, b in ROWS]
    want = [float(sum(examples[i].num_targets for i in idx)) for idx in core.batch_schedule(len(ROWS), 3, 2, 0)]
    assert _targets(root, "sft") == want
    # the model's turns and their EOS only: the call and the answer, not the template's or the tool's text
    first = examples[0]
    assert tok.decode([t for t, keep in zip(first.input_ids, first.target, strict=True) if keep]) == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*3"}}\n</tool_call><|eos|>36<|eos|>')
    # without the template: prompt + answer + EOS (the tool's reply untrained), other counts
    run(SFTConfig(base=root / "chat", prompts=root / "prompts", output=root / "plain_sft", max_steps=2,
                  batch_size=3, chat_template=False, seed=0))
    assert _targets(root, "plain_sft") != want


def test_a_template_asked_for_and_missing_is_a_config_error(data):
    root, _ = data
    with pytest.raises(ConfigError, match=rf"chat_template is true but the tokenizer of {root / 'plain'} has no chat template"):
        run(SFTConfig(base=root / "plain", prompts=root / "prompts", output=root / "x", max_steps=1, batch_size=2,
                      chat_template=True))
    with pytest.raises(ValueError, match="system_prompt needs the chat template"):
        SFTConfig(base=root / "plain", prompts=root / "prompts", output=root / "x", chat_template=False,
                  system_prompt="Hi.")
