"""The demo's arithmetic task: deterministic, disjoint splits, correct answers."""

from __future__ import annotations

import json

import pytest

from rlpipe.schemas import PROMPTS, read_manifest, read_table_artifact
from rlpipe.stages.task.arithmetic import (
    ArithmeticTask,
    Problem,
    all_problems,
    make_splits,
    tokenizer_texts,
    write_task,
)


def test_answers_are_correct():
    assert Problem(23, "+", 45).prompt == "23+45="
    assert Problem(23, "+", 45).answer == "68"
    assert Problem(45, "-", 23).answer == "22"
    assert Problem(7, "*", 8).text == "7*8=56"
    task = ArithmeticTask(a_range=(0, 12), b_range=(0, 12), ops=("+", "-", "*"))
    for p in all_problems(task):
        a, b, ans = p.a, p.b, int(p.answer)
        assert ans == {"+": a + b, "-": a - b, "*": a * b}[p.op]
        assert ans >= 0  # subtraction keeps a >= b


def test_problem_count_follows_the_knobs():
    assert len(all_problems(ArithmeticTask(a_range=(0, 9), b_range=(0, 9)))) == 100
    assert len(all_problems(ArithmeticTask(a_range=(0, 9), b_range=(0, 9), ops=("-",)))) == 55  # a >= b
    assert len(all_problems(ArithmeticTask(a_range=(10, 19), b_range=(0, 9), ops=("+", "*")))) == 200
    with pytest.raises(ValueError, match="b_range"):
        ArithmeticTask(b_range=(5, 2))
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops=("/",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="distinct problems"):
        make_splits(ArithmeticTask(a_range=(0, 9), b_range=(0, 9)), 90, 20, seed=0)


def test_splits_are_disjoint_and_seeded():
    task = ArithmeticTask(a_range=(0, 49), b_range=(0, 49))
    train, held = make_splits(task, 1000, 200, seed=3)
    assert len(train) == 1000 and len(held) == 200
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    assert len({p.prompt for p in train}) == 1000
    assert make_splits(task, 1000, 200, seed=3) == (train, held)
    other_train, _ = make_splits(task, 1000, 200, seed=4)
    assert other_train != train


def test_write_task_artifacts(tmp_path):
    task = ArithmeticTask(a_range=(0, 19), b_range=(0, 19))
    paths = write_task(tmp_path / "task", task, n_train=300, n_heldout=50, seed=0)
    train = read_table_artifact(paths["train"], PROMPTS).to_pylist()
    held = read_table_artifact(paths["heldout"], PROMPTS).to_pylist()
    assert len(train) == 300 and len(held) == 50
    assert not {r["prompt_id"] for r in train} & {r["prompt_id"] for r in held}
    row = train[0]
    meta = json.loads(row["metadata"])
    assert meta["split"] == "train" and meta["task"] == "arithmetic"
    assert row["prompt"] == f"{meta['a']}{meta['op']}{meta['b']}="
    assert int(row["answer"]) == meta["a"] + meta["b"]
    # Same seed -> same content; the manifest records the knobs.
    first = read_manifest(paths["train"]).content_hash
    write_task(tmp_path / "again", task, n_train=300, n_heldout=50, seed=0)
    assert read_manifest(tmp_path / "again" / "train").content_hash == first
    assert read_manifest(paths["train"]).config["task"]["a_range"] == [0, 19]
    # An extra SFT split: disjoint from both, and train/held-out unchanged by asking for it.
    three = write_task(tmp_path / "three", task, n_train=300, n_heldout=50, n_sft=40, seed=0)
    sft = read_table_artifact(three["sft"], PROMPTS).column("prompt_id").to_pylist()
    assert len(sft) == 40 and not set(sft) & ({r["prompt_id"] for r in train} | {r["prompt_id"] for r in held})
    assert read_manifest(three["train"]).content_hash == first


def test_tokenizer_splits_every_character():
    from rlpipe.stages.common.tiny import train_tokenizer

    tok = train_tokenizer(tokenizer_texts(ArithmeticTask(ops=("+", "*"))))
    ids = tok("23+45=").input_ids
    assert tok.convert_ids_to_tokens(ids) == ["<|bos|>", "2", "3", "+", "4", "5", "="]
    assert tok.convert_ids_to_tokens(tok("7*8=56").input_ids)[1:] == list("7*8=56")


def test_zero_padding_fixes_digit_positions():
    task = ArithmeticTask(a_range=(0, 99), b_range=(0, 9), zero_pad=True)
    assert task.width == 2
    p = Problem(7, "+", 5, task.width)
    assert (p.prompt, p.answer, p.prompt_id) == ("07+05=", "12", "07+05")
    assert {len(q.prompt) for q in all_problems(task)} == {6}
    assert ArithmeticTask().width == 0 and Problem(7, "+", 5).prompt == "7+5="


def test_a_question_form_changes_the_prompt_text_only(tmp_path):
    """`question` asks the same problems in words (for an instruct model): same ids, answers and
    split; a compact task's artifacts are what they were before the knob existed."""
    compact = ArithmeticTask(a_range=(0, 19), b_range=(0, 19))
    asked = ArithmeticTask(a_range=(0, 19), b_range=(0, 19), question="What is {a} {op} {b}? Reply with the number only.")
    p = Problem(17, "+", 5, 0, asked.question)
    assert (p.prompt, p.answer, p.prompt_id) == ("What is 17 + 5? Reply with the number only.", "22", "17+5")
    a = write_task(tmp_path / "compact", compact, n_train=30, n_heldout=5, seed=0)
    b = write_task(tmp_path / "asked", asked, n_train=30, n_heldout=5, seed=0)
    ra, rb = (read_table_artifact(x["train"], PROMPTS).to_pylist() for x in (a, b))
    assert [r["prompt_id"] for r in ra] == [r["prompt_id"] for r in rb]
    assert [r["answer"] for r in ra] == [r["answer"] for r in rb]
    assert rb[0]["prompt"] == asked.question.format(**{k: json.loads(rb[0]["metadata"])[k] for k in ("a", "op", "b")})
    assert "question" not in json.loads(ra[0]["metadata"]) and "question" not in read_manifest(a["train"]).config["task"]
    for bad in ("What is {x}?", "What is {a} {op} {b}? {", "{0}"):
        with pytest.raises(ValueError, match="only {a}, {op} and {b}"):
            ArithmeticTask(question=bad)
