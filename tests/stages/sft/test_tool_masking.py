"""SFT on tool-use answers: the environment's replies (`<tool_response>` blocks) are inputs, never
targets; each segment is tokenised on its own, as an episode does; plain answers encode as before."""

from __future__ import annotations

import pytest

from rlpipe.stages.common.tiny import train_tokenizer
from rlpipe.stages.rollout.environments.tools import tool_call_text, tool_response_text
from rlpipe.stages.sft.config import SFTConfig
from rlpipe.stages.sft.core import IGNORE, answer_segments, collate, encode_answer, encode_example
from rlpipe.stages.task.arithmetic import ArithmeticTask, calculator_trace, tokenizer_texts

CALL = tool_call_text("calculator", {"expression": "23*45"})
REPLY = "\n" + tool_response_text("1035") + "\n"  # what TextTurns inserts
PROMPT, ANSWER = "23*45=", calculator_trace(23, "*", 45, "1035")


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(tokenizer_texts(ArithmeticTask(a_range=(10, 99), b_range=(2, 9), ops=("*",)), tools=True))


def _ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def _encode(tok, answer, mask=True, loss_on="answer"):
    ids, trained = encode_answer(lambda t: _ids(tok, t), answer_segments(answer, mask))
    return encode_example(tok(PROMPT).input_ids, ids, tok.eos_token_id, 128, loss_on, trained)


def test_segments_split_at_the_replies():
    assert ANSWER == CALL + REPLY + "1035"
    assert answer_segments(ANSWER, True) == [(CALL, True), (REPLY, False), ("1035", True)]
    assert answer_segments(ANSWER, False) == [(ANSWER, True)]
    assert answer_segments("1035", True) == [("1035", True)]
    two = CALL + REPLY + CALL + REPLY + "7"  # non-greedy: two replies, the call between them trained
    assert answer_segments(two, True) == [(CALL, True), (REPLY, False), (CALL, True), (REPLY, False), ("7", True)]
    # a reply without the new lines around it, and one that ends the answer
    bare = tool_response_text("9")
    assert answer_segments("x" + bare + "y", True) == [("x", True), (bare, False), ("y", True)]
    assert answer_segments(CALL + REPLY, True) == [(CALL, True), (REPLY, False)]


def test_reply_tokens_carry_no_loss(tok):
    e = _encode(tok, ANSWER)
    prompt, call, reply, final = tok(PROMPT).input_ids, _ids(tok, CALL), _ids(tok, REPLY), _ids(tok, "1035")
    # golden sizes with the tool tokenizer: BOS + 6, the call 31, the reply 18, the answer 4 (+ EOS)
    assert [len(x) for x in (prompt, call, reply, final)] == [7, 31, 18, 4]
    assert e.input_ids == prompt + call + reply + final + [tok.eos_token_id]
    assert e.target == [False] * 7 + [True] * 31 + [False] * 18 + [True] * 4 + [True]
    assert e.num_targets == 36
    # loss_on 'all' trains the prompt too, but still never the reply
    full = _encode(tok, ANSWER, loss_on="all")
    assert full.target == [False] + [True] * 6 + [True] * 31 + [False] * 18 + [True] * 5
    # mask_tool_responses off: the whole answer is one trained segment
    off = _encode(tok, ANSWER, mask=False)
    assert off.input_ids == prompt + _ids(tok, ANSWER) + [tok.eos_token_id]
    assert off.target == [False] * 7 + [True] * (len(off.input_ids) - 7)


def test_labels_are_ignored_over_the_reply(tok):
    e = _encode(tok, ANSWER)
    plain = _encode(tok, "945")
    ids, _, labels = collate([e, plain], pad_id=tok.pad_token_id)
    # labels[i] predicts token i+1: positions 37..54 would predict the reply's 18 tokens
    start = 7 + 31
    assert labels[0, start - 1 : start - 1 + 18].tolist() == [IGNORE] * 18
    assert labels[0, start - 2].item() == ids[0, start - 1].item()  # the call's last token is learnt
    assert labels[0, start - 1 + 18 : start - 1 + 23].tolist() == ids[0, start + 18 : start + 23].tolist()
    assert (labels[0] != IGNORE).sum().item() == e.num_targets == 36


def test_plain_answers_encode_as_before(tok):
    for answer in ("1035", "068", "", "12\n34"):
        before = encode_example(tok(PROMPT).input_ids, _ids(tok, answer), tok.eos_token_id, 128, "answer")
        assert _encode(tok, answer) == before


def test_answer_trained_must_fit():
    with pytest.raises(ValueError, match="2 flags for 3 answer tokens"):
        encode_example([1], [5, 6, 7], 2, 64, "answer", [True, False])
    cut = encode_example([1, 4], [5, 6, 7], 2, max_length=4, loss_on="answer", answer_trained=[True, False, True])
    assert cut.input_ids == [1, 4, 5, 6] and cut.target == [False, False, True, False]


def test_config_knob(tmp_path):
    cfg = SFTConfig(base=tmp_path / "b", prompts=tmp_path / "p", output=tmp_path / "o")
    assert cfg.mask_tool_responses is True
    assert SFTConfig(base=tmp_path / "b", prompts=tmp_path / "p", output=tmp_path / "o",
                     mask_tool_responses=False).mask_tool_responses is False


def test_stage_trains_only_the_model_tokens(tmp_path):
    """The sft stage end to end on traced answers: its target count is the model-written tokens."""
    from rlpipe.schemas import METRICS, PROMPTS, read_table_artifact
    from rlpipe.stages.base_model.run import make_base_checkpoint
    from rlpipe.stages.sft.run import run
    from rlpipe.stages.task.arithmetic import write_mixed_format_copy, write_task

    task = ArithmeticTask(a_range=(10, 99), b_range=(2, 9), ops=("*",))
    train = write_task(tmp_path / "task", task, n_train=16, n_heldout=1, seed=0)["train"]
    write_mixed_format_copy(train, tmp_path / "sft_prompts", fraction=0.0, seed=0, tool_fraction=0.5)
    make_base_checkpoint(tmp_path / "base", tokenizer_texts(task, tools=True), size="micro")
    cfg = SFTConfig(base=tmp_path / "base", prompts=tmp_path / "sft_prompts", output=tmp_path / "sft",
                    max_steps=1, batch_size=16)
    run(cfg)
    rows = read_table_artifact(tmp_path / "sft_prompts", PROMPTS).to_pylist()
    tok = train_tokenizer(tokenizer_texts(task, tools=True))
    expected, traced = 0, 0
    for r in rows:
        final = r["answer"].rsplit("\n", 1)[-1]  # the answer after the reply (the whole of a plain one)
        if r["answer"].startswith("<tool_call>"):
            traced += 1
            call = r["answer"].split("\n<tool_response>")[0]
            expected += len(_ids(tok, call))
        expected += len(_ids(tok, final)) + 1  # + EOS
    assert 0 < traced < len(rows)
    metrics = read_table_artifact(cfg.metrics_path, METRICS).to_pylist()
    assert [m["value"] for m in metrics if m["name"] == "target_tokens"] == [expected]
