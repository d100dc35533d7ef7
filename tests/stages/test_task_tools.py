"""The task stage's tool-use warm-start data (sft_tool_fraction) and the tokenizer texts of the
call format: calculator traces in the raw-text episode format, seeded, composing with padding."""

from __future__ import annotations

import json

import pytest

from rlpipe.schemas import PROMPTS, read_manifest, read_table_artifact
from rlpipe.schemas.config_files import ConfigError
from rlpipe.stages.rollout.environments.tools import (
    parse_tool_calls,
    tool_call_text,
    tool_response_text,
)
from rlpipe.stages.task.arithmetic import (
    ArithmeticTask,
    Problem,
    calculator_trace,
    tokenizer_texts,
    write_mixed_format_copy,
    write_task,
)
from rlpipe.stages.task.config import TaskConfig

TASK = ArithmeticTask(a_range=(10, 99), b_range=(2, 9), ops=("*",))


def test_trace_is_the_episode_format():
    trace = calculator_trace(23, "*", 45, "1035")
    assert trace == ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "23*45"}}\n</tool_call>'
                     "\n<tool_response>\n1035\n</tool_response>\n1035")
    # what the model writes parses as the call the environment runs
    (call,) = parse_tool_calls(trace)
    assert (call.name, call.arguments, call.error) == ("calculator", {"expression": "23*45"}, None)
    # operands unpadded: the calculator cannot read '07'
    assert '"7+5"' in calculator_trace(7, "+", 5, "12")


@pytest.fixture
def train(tmp_path):
    # the demo's sums: two-digit answers, which padding to three digits changes
    sums = ArithmeticTask(a_range=(0, 99), b_range=(0, 9), ops=("+",))
    return write_task(tmp_path / "task", sums, n_train=400, n_heldout=10, seed=0)["train"]


def _answers(path):
    return read_table_artifact(path, PROMPTS).column("answer").to_pylist()


def test_tool_fraction_zero_changes_nothing(tmp_path, train):
    plain = write_mixed_format_copy(train, tmp_path / "a", fraction=0.5, pad_from=50, seed=1)
    zero = write_mixed_format_copy(train, tmp_path / "b", fraction=0.5, pad_from=50, seed=1, tool_fraction=0.0)
    assert plain.content_hash == zero.content_hash
    assert "tool_fraction" not in read_manifest(tmp_path / "b").config  # the manifest as before the knob


def test_tool_traces_are_seeded_and_compose_with_padding(tmp_path, train):
    rows = read_table_artifact(train, PROMPTS).to_pylist()
    write_mixed_format_copy(train, tmp_path / "p", fraction=0.5, pad_from=50, seed=1)
    padded = _answers(tmp_path / "p")
    write_mixed_format_copy(train, tmp_path / "t", fraction=0.5, pad_from=50, seed=1, tool_fraction=0.3)
    traced = _answers(tmp_path / "t")
    n_traced = 0
    for row, pad, ans in zip(rows, padded, traced, strict=True):
        m = json.loads(row["metadata"])
        if ans == pad:
            continue
        n_traced += 1
        # a trace of the canonical result, ending in the answer as the padding left it
        expr = f"{m['a']}{m['op']}{m['b']}"
        assert ans == (tool_call_text("calculator", {"expression": expr}) + "\n"
                       + tool_response_text(row["answer"]) + "\n" + pad)
    assert 0.2 < n_traced / len(rows) < 0.4
    assert any(a.endswith("\n0" + r["answer"]) for a, r in zip(traced, rows, strict=True))  # padded after a trace
    # same seed, same copy; another seed, other rows
    again = write_mixed_format_copy(train, tmp_path / "t2", fraction=0.5, pad_from=50, seed=1, tool_fraction=0.3)
    assert again.content_hash == read_manifest(tmp_path / "t").content_hash
    write_mixed_format_copy(train, tmp_path / "t3", fraction=0.5, pad_from=50, seed=2, tool_fraction=0.3)
    assert _answers(tmp_path / "t3") != traced
    assert read_manifest(tmp_path / "t").config["tool_fraction"] == 0.3


def test_all_traced_without_padding(tmp_path, train):
    write_mixed_format_copy(train, tmp_path / "t", fraction=0.0, seed=0, tool_fraction=1.0)
    rows = read_table_artifact(train, PROMPTS).to_pylist()
    for row, ans in zip(rows, _answers(tmp_path / "t"), strict=True):
        assert ans.startswith("<tool_call>") and ans.endswith("</tool_response>\n" + row["answer"])


def test_config_sets_sft_for_either_fraction(tmp_path):
    paths = dict(train=tmp_path / "t", heldout=tmp_path / "h", sft=tmp_path / "s")
    assert TaskConfig(**paths, sft_tool_fraction=0.3).sft_tool_fraction == 0.3
    with pytest.raises(ValueError, match="sft_padded_fraction and sft_tool_fraction are 0"):
        TaskConfig(**paths)
    with pytest.raises(ValueError, match="sft_tool_fraction"):
        TaskConfig(**paths, sft_tool_fraction=1.5)


def test_tokenizer_texts_without_tools_unchanged():
    task = ArithmeticTask(ops=("+", "*"))
    expected = ["0123456789", "=", "+", "*"] + [Problem(a, op, a).text for op in ("+", "*") for a in range(10)]
    assert tokenizer_texts(task) == expected
    with_tools = tokenizer_texts(task, tools=True)
    assert with_tools[: len(expected)] == expected and len(with_tools) > len(expected)
    assert all(t.startswith("<tool_call>") for t in with_tools[len(expected):])


def test_tokenizer_learns_the_call_format():
    from rlpipe.stages.common.tiny import train_tokenizer

    tok = train_tokenizer(tokenizer_texts(TASK, tools=True))

    def n(text):
        return len(tok(text, add_special_tokens=False).input_ids)

    call = tool_call_text("calculator", {"expression": "23*45"})
    reply = "\n" + tool_response_text("1035") + "\n"
    # byte-level pieces ('<', 'tool', '_', 'call', '>', ...) merge into words: 26 + 5 tokens, not 85 bytes
    assert (n(call), n(reply)) == (31, 18)
    for word in ("tool", "call", "response", "calculator", "arguments", "expression"):
        assert n(word) == 1, word
    bare = train_tokenizer(tokenizer_texts(TASK))
    assert len(bare(call, add_special_tokens=False).input_ids) == len(call.encode())


def test_plan_writes_the_sft_copy_and_the_tool_tokenizer():
    from pathlib import Path

    from rlpipe.pipelines.layout import RunLayout
    from rlpipe.pipelines.plan import Plan
    from rlpipe.pipelines.preset import load_preset

    def setup(*overrides):
        preset = load_preset("demo", list(overrides))
        calls = {c.name: c.config for c in Plan(preset, RunLayout(Path("runs") / "x")).setup()}
        return calls["task"], calls["base_model"]

    task, base = setup("data.task.sft_padded_fraction=0", "data.task.sft_tool_fraction=0.3")
    assert task.sft is not None and task.sft_tool_fraction == 0.3
    assert any("<tool_call>" in t for t in base.tokenizer_texts)
    task, base = setup()
    assert task.sft is not None and not any("<tool_call>" in t for t in base.tokenizer_texts)
    with pytest.raises(ConfigError):
        setup("data.task.sft_tool_fraction=2")
