"""The import_data stage: every format gives the same artifact, columns map as named, and bad
rows are refused with the file, the column and the file's own line / row numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlpipe.schemas import read_table_artifact, validate_artifact
from rlpipe.schemas.config_files import ConfigError, parse_config
from rlpipe.stages.import_data.config import ImportDataConfig
from rlpipe.stages.import_data.rows import content_id
from rlpipe.stages.import_data.run import run
from rlpipe.stages.import_data.sources import DataImportError

ROWS = [{"q": "What is 2+3?", "sol": "5", "topic": "add"},
        {"q": "Name a prime.", "sol": "7", "topic": "primes"},
        {"q": "Café au lait?", "sol": "oui", "topic": "é"}]  # non-ASCII, valid UTF-8


def _import(source: Path, out: Path, **mapping):
    return run(parse_config(ImportDataConfig, {"source": source, "prompts": out, **mapping}))


def _write(path: Path, rows: list[dict]) -> Path:
    """`rows` in the format of path's suffix."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    elif path.suffix == ".csv":
        cols = list(rows[0])
        path.write_text(",".join(cols) + "\n" + "".join(",".join(r[c] for c in cols) + "\n" for r in rows))
    elif path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        import datasets

        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("name", ["p.jsonl", "p.csv", "p.parquet", "p_datasets"])
def test_every_format_gives_the_same_artifact(tmp_path, name):
    reference = _import(_write(tmp_path / "ref.jsonl", ROWS), tmp_path / "ref", prompt="q", answer="sol")
    m = _import(_write(tmp_path / name, ROWS), tmp_path / "out", prompt="q", answer="sol")
    assert validate_artifact(tmp_path / "out") == []
    rows = read_table_artifact(tmp_path / "out").to_pylist()
    assert [r["prompt"] for r in rows] == [r["q"] for r in ROWS]
    assert [r["answer"] for r in rows] == [r["sol"] for r in ROWS]
    assert [json.loads(r["metadata"]) for r in rows] == [{"topic": r["topic"]} for r in ROWS]
    # ids are the content hash of the imported row, so the content (and its hash) is the same
    assert [r["prompt_id"] for r in rows] == [
        content_id({"prompt": r["q"], "answer": r["sol"], "metadata": json.dumps({"topic": r["topic"]}, ensure_ascii=False),
                    "messages": None}) for r in ROWS]
    assert m.content_hash == reference.content_hash


def test_generated_ids_follow_the_row_not_its_position(tmp_path):
    _import(_write(tmp_path / "a.jsonl", ROWS), tmp_path / "a", prompt="q")
    _import(_write(tmp_path / "b.jsonl", ROWS[::-1]), tmp_path / "b", prompt="q")
    a, b = (read_table_artifact(tmp_path / n).to_pylist() for n in ("a", "b"))
    assert {r["prompt_id"]: r["prompt"] for r in a} == {r["prompt_id"]: r["prompt"] for r in b}
    assert [r["prompt_id"] for r in a] == [r["prompt_id"] for r in b][::-1]


def test_id_column_messages_and_metadata_object(tmp_path):
    rows = [{"id": 7, "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
             "answer": 4, "metadata": {"tests": ["assert f(2) == 4"]}, "source": "x"},
            {"id": 8, "messages": json.dumps([{"role": "user", "content": "3+3?"}]), "answer": None}]
    _import(_write(tmp_path / "chat.jsonl", rows), tmp_path / "out")
    out = read_table_artifact(tmp_path / "out").to_pylist()
    assert [r["prompt_id"] for r in out] == ["7", "8"]
    assert out[0]["messages"] == rows[0]["messages"] and out[1]["messages"] == [{"role": "user", "content": "3+3?"}]
    assert [r["prompt"] for r in out] == ["2+2?", "3+3?"]  # the last user turn
    assert [r["answer"] for r in out] == ["4", None]
    assert json.loads(out[0]["metadata"]) == {"tests": ["assert f(2) == 4"], "source": "x"}
    assert out[1]["metadata"] is None


def test_preferences(tmp_path):
    src = tmp_path / "pairs.csv"
    src.write_text('question,good,bad,m,note\nQ1,yes,no,0.5,a\n"Q2\nsecond line",fine,poor,,b\n')
    m = run(parse_config(ImportDataConfig, {"source": src, "preferences": tmp_path / "out", "prompt": "question",
                                            "chosen": "good", "rejected": "bad", "margin": "m"}))
    out = read_table_artifact(tmp_path / "out").to_pylist()
    assert [(r["prompt"], r["chosen"], r["rejected"], r["margin"]) for r in out] == [
        ("Q1", "yes", "no", 0.5), ("Q2\nsecond line", "fine", "poor", None)]
    assert m.extra["ignored_columns"] == ["note"]
    src.write_text("question,good,bad,m\nQ1,yes,no,0.5\nQ2,fine,poor,lots\n")
    with pytest.raises(DataImportError, match=rf"{src}: column 'm' is not a finite number at line 3$"):
        run(parse_config(ImportDataConfig, {"source": src, "preferences": tmp_path / "o2", "prompt": "question",
                                            "chosen": "good", "rejected": "bad", "margin": "m"}))


def test_repeated_ids_are_refused_with_lines(tmp_path):
    src = tmp_path / "dup.jsonl"
    src.write_text('{"id": "a", "prompt": "x"}\n\n{"id": "b", "prompt": "y"}\n{"id": "a", "prompt": "z"}\n'
                   '{"id": "b", "prompt": "w"}\n')
    with pytest.raises(DataImportError, match=rf"{src}: column 'id' repeats ids: 'a' at lines 1, 4; 'b' at lines 3, 5"):
        _import(src, tmp_path / "out")


def test_repeated_prompts_without_ids_are_kept_each_with_its_own_stable_id(tmp_path):
    """RL data sets repeat prompts (TRL trains on each repeat): without an id column each repeat
    is its own row, its id the content id numbered by repeat, the same on a second import."""
    from rlpipe.schemas import read_table_artifact

    src = tmp_path / "repeats.jsonl"
    src.write_text('{"prompt": "x"}\n{"prompt": "y"}\n{"prompt": "x"}\n{"prompt": "x"}\n')
    _import(src, tmp_path / "out")
    ids = read_table_artifact(tmp_path / "out").column("prompt_id").to_pylist()
    x, y = ids[:2]
    assert ids == [x, y, f"{x}-1", f"{x}-2"] and x != y and all(len(i) == 16 for i in (x, y))
    _import(src, tmp_path / "again")
    assert read_table_artifact(tmp_path / "again").column("prompt_id").to_pylist() == ids


def test_empty_prompts_are_refused_with_rows(tmp_path):
    pq.write_table(pa.table({"prompt": ["a", " ", None, "b"]}), tmp_path / "e.parquet")
    with pytest.raises(DataImportError, match=r"e.parquet: column 'prompt' is empty \(nothing to ask\) at rows 1, 2 \(counted from 0\)"):
        _import(tmp_path / "e.parquet", tmp_path / "out")
    (tmp_path / "m.jsonl").write_text('{"messages": [{"role": "user", "content": ""}]}\n{"messages": []}\n')
    with pytest.raises(DataImportError, match=r"column 'messages' is not a list of \{role, content\} turns .* at line 2$"):
        _import(tmp_path / "m.jsonl", tmp_path / "out")


def test_text_that_is_not_utf8_is_refused_by_column_and_rows(tmp_path):
    (tmp_path / "l.csv").write_bytes(b"prompt,note\nfine,ok\ncaf\xe9,ok\nalso fine,na\xefve\n\xff,x\n")
    with pytest.raises(DataImportError, match=r"l.csv: column 'prompt' holds text that is not UTF-8 .* at lines 3, 5$"):
        _import(tmp_path / "l.csv", tmp_path / "out")
    # Parquet strings are meant to be UTF-8; a writer that broke that is caught per row too.
    bad = pa.array([b"ok", b"caf\xe9", b"ok"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "note": bad}), tmp_path / "l.parquet")
    with pytest.raises(DataImportError, match=r"column 'note' holds text that is not UTF-8 .* at row 1 \(counted from 0\)"):
        _import(tmp_path / "l.parquet", tmp_path / "out")


def test_mapping_errors(tmp_path):
    src = _write(tmp_path / "p.jsonl", ROWS)
    with pytest.raises(DataImportError, match=r"p.jsonl: no 'prompt' or 'messages' column; columns: q, sol, topic: "
                                              r"name one with --prompt COL or --messages COL"):
        _import(src, tmp_path / "out")
    with pytest.raises(DataImportError, match=r"no column 'solution' \(given as answer\); columns: q, sol, topic"):
        _import(src, tmp_path / "out", prompt="q", answer="solution")
    with pytest.raises(ConfigError, match="chosen name columns of the other kind of import"):
        _import(src, tmp_path / "out", prompt="q", chosen="sol")
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(DataImportError, match="unknown format '.txt'"):
        _import(tmp_path / "x.txt", tmp_path / "out")
