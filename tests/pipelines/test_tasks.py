"""The demo's arithmetic task: deterministic, disjoint splits, correct answers."""

from __future__ import annotations

import json

import pytest
from rlpipe.pipelines.tasks import (
    ArithmeticTask,
    Problem,
    all_problems,
    make_splits,
    tokenizer_texts,
    write_task,
)
from rlpipe.schemas import PROMPTS, read_manifest, read_table_artifact


def test_answers_are_correct():
    assert Problem(23, "+", 45).prompt == "23+45="
    assert Problem(23, "+", 45).answer == "68"
    assert Problem(45, "-", 23).answer == "22"
    assert Problem(7, "*", 8).text == "7*8=56"
    task = ArithmeticTask(max_operand=12, ops=("+", "-", "*"))
    for p in all_problems(task):
        a, b, ans = p.a, p.b, int(p.answer)
        assert ans == {"+": a + b, "-": a - b, "*": a * b}[p.op]
        assert ans >= 0  # subtraction keeps a >= b


def test_problem_count_follows_the_knobs():
    assert len(all_problems(ArithmeticTask(max_operand=9))) == 100
    assert len(all_problems(ArithmeticTask(max_operand=9, ops=("-",)))) == 55  # a >= b
    assert len(all_problems(ArithmeticTask(min_operand=10, max_operand=19, ops=("+", "*")))) == 200
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops=("/",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="distinct problems"):
        make_splits(ArithmeticTask(max_operand=9), 90, 20, seed=0)


def test_splits_are_disjoint_and_seeded():
    task = ArithmeticTask(max_operand=49)
    train, held = make_splits(task, 1000, 200, seed=3)
    assert len(train) == 1000 and len(held) == 200
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    assert len({p.prompt for p in train}) == 1000
    assert make_splits(task, 1000, 200, seed=3) == (train, held)
    other_train, _ = make_splits(task, 1000, 200, seed=4)
    assert other_train != train


def test_write_task_artifacts(tmp_path):
    task = ArithmeticTask(max_operand=19)
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
    assert read_manifest(paths["train"]).config["task"]["max_operand"] == 19


def test_tokenizer_splits_every_character():
    from rlpipe.stages.common.tiny import train_tokenizer

    tok = train_tokenizer(tokenizer_texts(ArithmeticTask(ops=("+", "*"))))
    ids = tok("23+45=").input_ids
    assert tok.convert_ids_to_tokens(ids) == ["<|bos|>", "2", "3", "+", "4", "5", "="]
    assert tok.convert_ids_to_tokens(tok("7*8=56").input_ids)[1:] == list("7*8=56")
