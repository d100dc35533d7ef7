"""The rollout stage's prompt handling: chat templates, metadata carried to rollouts, and the
prompts it refuses (repeated ids, empty prompts)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlpipe.schemas import PROMPTS, read_manifest, read_table_artifact, write_table_artifact
from rlpipe.stages.rollout.config import RolloutConfig
from rlpipe.stages.rollout.run import run

#: A small chat template: BOS, then '<role>content' per turn, then '<assistant>' to answer.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def _config(policy: Path, prompts: Path, out: Path, **kw) -> RolloutConfig:
    return RolloutConfig(checkpoint=policy, prompts=prompts, output=out, group_size=2, max_new_tokens=3, **kw)


def _write(path: Path, rows: list[dict]) -> Path:
    cols = {c: [r.get(c) for r in rows] for c in PROMPTS.column_names}
    write_table_artifact(path, PROMPTS, cols, stage="test")
    return path


@pytest.fixture(scope="module")
def chat_policy(tiny_policy_dir, tiny_tokenizer, tmp_path_factory) -> Path:
    """The tiny policy whose tokenizer has a chat template."""
    out = tmp_path_factory.mktemp("chat_policy") / "policy"
    shutil.copytree(tiny_policy_dir, out)
    tok = type(tiny_tokenizer).from_pretrained(out)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)
    return out


CHATS = [
    {"prompt_id": "plain", "prompt": "Q: 1+2= A:", "metadata": json.dumps({"tests": [1, 2]})},
    {"prompt_id": "chat", "prompt": "Q: 3+4= A:", "metadata": None,
     "messages": [{"role": "user", "content": "Q: 3+4="}, {"role": "assistant", "content": "A: 7"},
                  {"role": "user", "content": "Q: 3+4= A:"}]},
    {"prompt_id": "own_system", "prompt": "Q: 5+5= A:", "metadata": json.dumps({"choices": ["10", "11"]}),
     "messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": "Q: 5+5= A:"}]},
]


def test_stored_prompt_ids_are_the_templated_ones(chat_policy, tmp_path):
    from transformers import AutoTokenizer

    prompts = _write(tmp_path / "prompts", CHATS)
    run(_config(chat_policy, prompts, tmp_path / "r", system_prompt="Be brief."))
    tok = AutoTokenizer.from_pretrained(chat_policy)
    # Written out, not built with the stage's own helper: a plain prompt is one user turn, the
    # system prompt goes first unless the messages bring their own.
    expected_turns = {
        "plain": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q: 1+2= A:"}],
        "chat": [{"role": "system", "content": "Be brief."}, *CHATS[1]["messages"]],
        "own_system": CHATS[2]["messages"],
    }
    rows = read_table_artifact(tmp_path / "r").to_pylist()
    assert len(rows) == 6
    for row in rows:
        want = tok.apply_chat_template(expected_turns[row["prompt_id"]], add_generation_prompt=True)
        want = want["input_ids"] if hasattr(want, "keys") else want  # transformers 5: a BatchEncoding
        assert row["prompt_token_ids"] == list(want), row["prompt_id"]
        # the template changed the tokens: BOS + '<system>Be brief.' ... is longer than BOS + prompt
        assert len(row["prompt_token_ids"]) > len(tok(row["prompt"]).input_ids)
        source = next(c for c in CHATS if c["prompt_id"] == row["prompt_id"])
        assert row["metadata"] == source["metadata"]  # metadata rides along, null stays null
        assert row["prompt"] == source["prompt"]
    # (recorded: a TRL-style reward function then gets prompts and completions as messages)
    assert read_manifest(tmp_path / "r").extra["sampled_by"]["chat_template"] is True


def test_chat_template_false_tokenizes_plain_prompts_as_is(chat_policy, tmp_path):
    from transformers import AutoTokenizer

    prompts = _write(tmp_path / "prompts", [CHATS[0]])
    run(_config(chat_policy, prompts, tmp_path / "r", chat_template=False))
    tok = AutoTokenizer.from_pretrained(chat_policy)
    row = read_table_artifact(tmp_path / "r").to_pylist()[0]
    assert row["prompt_token_ids"] == tok("Q: 1+2= A:").input_ids
    assert read_manifest(tmp_path / "r").extra["sampled_by"]["chat_template"] is False


def test_messages_without_a_template_are_refused(chat_policy, tiny_policy_dir, tmp_path):
    prompts = _write(tmp_path / "prompts", CHATS)
    with pytest.raises(ValueError, match=r"gives prompts as chat messages \(prompt_id 'chat'.*chat_template is false"):
        run(_config(chat_policy, prompts, tmp_path / "r1", chat_template=False))
    with pytest.raises(ValueError, match=r"chat messages .* has no chat template"):
        run(_config(tiny_policy_dir, prompts, tmp_path / "r2"))  # 'auto', tokenizer without one
    with pytest.raises(ValueError, match="chat_template is true but the tokenizer of .* has no chat template"):
        run(_config(tiny_policy_dir, prompts, tmp_path / "r3", chat_template=True))
    with pytest.raises(ValueError, match="system_prompt needs the chat template"):
        _config(tiny_policy_dir, prompts, tmp_path / "r4", chat_template=False, system_prompt="x")


def test_repeated_ids_and_empty_prompts_are_refused_with_rows(tiny_policy_dir, tmp_path):
    rows = [{"prompt_id": f"p{i}", "prompt": f"Q: {i}+1= A:"} for i in range(6)]
    dup = _write(tmp_path / "dup", [*rows[:2], {**rows[2], "prompt_id": "p0"}, *rows[3:], {**rows[5], "prompt_id": "p1"}])
    with pytest.raises(ValueError, match=rf"prompts artifact {dup}: column 'prompt_id' repeats ids "
                                         r"\('p0' at rows 0, 2; 'p1' at rows 1, 6; rows counted from 0"):
        run(_config(tiny_policy_dir, dup, tmp_path / "r"))
    empty = _write(tmp_path / "empty", [*rows[:3], {**rows[3], "prompt": "  \n"},
                                        {**rows[4], "prompt": "x", "messages": [{"role": "user", "content": " "}]},
                                        rows[5]])
    with pytest.raises(ValueError, match=rf"prompts artifact {empty}: empty prompts .* at rows 3, 4 \(counted from 0"):
        run(_config(tiny_policy_dir, empty, tmp_path / "r"))


#: TEMPLATE, naming the tools first when there are any (their whole JSON schemas would not fit the
#: tiny model's context).
TOOLS_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }}:"
                  "{{ t['function']['parameters']['required'] | join(',') }} {% endfor %}{% endif %}" + TEMPLATE)


@pytest.mark.multiturn
def test_episodes_open_with_the_template_showing_the_tools_and_reply_as_it_renders(
        chat_policy, tiny_tokenizer, tmp_path, monkeypatch):
    """With a chat template, an episode's prompt is the template's rendering of the opening
    messages with the tools' schemas and the system prompt; each environment reply is the
    template's rendering of the reply message and the next generation prompt, after the close of
    the model's turn (the template's '\n', unless the model wrote it)."""
    from rlpipe.stages.rollout.environments import EnvironmentSpec, make_environment

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # user_environments.py
    policy = tmp_path / "policy"
    shutil.copytree(chat_policy, policy)
    tok = type(tiny_tokenizer).from_pretrained(policy)
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(policy)
    prompts = _write(tmp_path / "p", [{"prompt_id": "q", "prompt": "Q: 6*7="}])
    tools = {"name": "tools", "kwargs": {"tools": ["calculator"]}}
    opening = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Q: 6*7="}]
    schemas = make_environment(EnvironmentSpec(**tools))().schemas
    want = tok.apply_chat_template(opening, tools=schemas, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert tok.decode(want, skip_special_tokens=True).startswith("<tools>calculator:expression <system>Use tools.\n<user>Q: 6*7=\n<assistant>")
    run(_config(policy, prompts, tmp_path / "tools", environment=tools, system_prompt="Use tools."))
    assert all(r["prompt_token_ids"] == want for r in read_table_artifact(tmp_path / "tools", "rollouts").to_pylist())

    echo = {"function": "user_environments:make_echo", "kwargs": {"reply": "Q: 1+1="}, "max_turns": 2}
    run(_config(policy, prompts, tmp_path / "echo", environment=echo, system_prompt="Use tools."))
    for row in read_table_artifact(tmp_path / "echo", "rollouts").to_pylist():
        model, env, _ = row["turns"]
        reply = tok.decode(row["response_token_ids"][env["start"]:env["end"]])
        wrote_newline = tok.decode(row["response_token_ids"][model["end"] - 1:model["end"]]) == "\n"
        assert reply == ("" if wrote_newline else "\n") + "<user>Q: 1+1=\n<assistant>"
