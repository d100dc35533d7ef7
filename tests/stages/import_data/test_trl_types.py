"""TRL's dataset types imported as they are (https://huggingface.co/docs/trl/dataset_formats):
prompt-only and prompt-completion, preference with an explicit or implicit prompt, standard or
conversational. A conversational prompt reaches the policy as its chat template renders it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlpipe.schemas import read_table_artifact
from rlpipe.schemas.config_files import parse_config
from rlpipe.stages.import_data.config import ImportDataConfig
from rlpipe.stages.import_data.run import run
from rlpipe.stages.import_data.sources import DataImportError

pytestmark = pytest.mark.hf

SYSTEM = {"role": "system", "content": "You add numbers."}


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _import(tmp_path: Path, rows: list[dict], kind: str = "prompts", name: str = "data") -> list[dict]:
    """`rows` as a JSON Lines file in tmp_path/<name>/, imported as `kind` beside it."""
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    run(parse_config(ImportDataConfig, {"source": _jsonl(folder / f"{kind}.jsonl", rows), kind: folder / kind}))
    return read_table_artifact(folder / kind).to_pylist()


def test_prompt_only_and_prompt_completion_standard_and_conversational(tmp_path):
    rows = _import(tmp_path, [
        {"prompt": [SYSTEM, {"role": "user", "content": "2+3?"}]},  # conversational prompt-only
        {"prompt": [{"role": "user", "content": "1+1?"}], "completion": [{"role": "assistant", "content": "2"}]},
    ])
    assert [r["messages"] for r in rows] == [[SYSTEM, {"role": "user", "content": "2+3?"}],
                                             [{"role": "user", "content": "1+1?"}]]
    assert [(r["prompt"], r["answer"]) for r in rows] == [("2+3?", None), ("1+1?", "2")]  # the last user turn
    standard = _import(tmp_path, [{"prompt": "The sky is", "completion": " blue."}], name="standard")
    assert [(r["prompt"], r["answer"], r["messages"]) for r in standard] == [("The sky is", " blue.", None)]
    # an `answer` column wins over `completion` (which then is metadata, as any other column)
    both = _import(tmp_path, [{"prompt": "2+2=", "completion": "four", "answer": "4"}], name="both")
    assert both[0]["answer"] == "4" and json.loads(both[0]["metadata"]) == {"completion": "four"}
    with pytest.raises(DataImportError, match=r"column 'completion' holds chat turns that are not one assistant "
                                              r"turn .* at line 1$"):
        _import(tmp_path, [{"prompt": "hi", "completion": [{"role": "user", "content": "no"}]}], name="bad")


@pytest.mark.parametrize("form", ["standard explicit", "standard implicit", "conversational explicit",
                                  "conversational implicit"])
def test_every_preference_form_gives_the_same_pairs(tmp_path, form):
    q, good, bad = "The sky is", " blue.", " green."
    user = {"role": "user", "content": "What color is the sky?"}
    said = {"role": "assistant", "content": "Blue."}, {"role": "assistant", "content": "Green."}
    row = {"standard explicit": {"prompt": q, "chosen": good, "rejected": bad},
           "standard implicit": {"chosen": q + good, "rejected": q + bad},
           "conversational explicit": {"prompt": [SYSTEM, user], "chosen": [said[0]], "rejected": [said[1]]},
           "conversational implicit": {"chosen": [SYSTEM, user, said[0]], "rejected": [SYSTEM, user, said[1]]}}[form]
    [pair] = _import(tmp_path, [row], "preferences")
    expected = (q, good, bad) if form.startswith("standard") else ("What color is the sky?", "Blue.", "Green.")
    assert (pair["prompt"], pair["chosen"], pair["rejected"]) == expected


def test_preference_rows_that_fit_no_form_are_refused_with_their_lines(tmp_path):
    user = {"role": "user", "content": "Q?"}
    rows = [{"chosen": [user, {"role": "assistant", "content": "a"}], "rejected": [user, {"role": "assistant", "content": "b"}]},
            {"chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]}]
    with pytest.raises(DataImportError, match=r"columns 'chosen', 'rejected' have no user turn before the responses "
                                              r"\(nothing to ask\) at line 2$"):
        _import(tmp_path, rows, "preferences")
    with pytest.raises(DataImportError, match=r"'chosen' share no beginning \(no implicit prompt\) at line 1$"):
        _import(tmp_path, [{"chosen": "yes", "rejected": "no"}], "preferences", name="text")


def test_a_conversational_prompt_reaches_the_policy_as_its_chat_template_renders_it(tmp_path, smollm2_tokenizer):
    """TRL's conversational prompt-only data, imported without naming a column, then rolled out
    on a model with SmolLM2's tokenizer and ChatML template: the policy's prompt ids are the
    template's rendering of the turns."""
    from rlpipe.stages.common.tiny import build_model, save_pretrained
    from rlpipe.stages.rollout.config import RolloutConfig
    from rlpipe.stages.rollout.run import run as rollout

    turns = [[SYSTEM, {"role": "user", "content": "2+3?"}], [{"role": "user", "content": "What is 1+1?"}]]
    _import(tmp_path, [{"prompt": t, "answer": a} for t, a in zip(turns, ("5", "2"), strict=True)])
    policy = save_pretrained(build_model(smollm2_tokenizer, "causal", size="micro", seed=0), smollm2_tokenizer,
                             tmp_path / "policy")
    rollout(parse_config(RolloutConfig, {"checkpoint": policy, "prompts": tmp_path / "data" / "prompts",
                                         "output": tmp_path / "rollouts", "group_size": 1, "max_new_tokens": 2}))
    rolled = read_table_artifact(tmp_path / "rollouts").to_pylist()
    by_prompt = {r["prompt"]: r["prompt_token_ids"] for r in rolled}
    for t in turns:
        rendered = smollm2_tokenizer.apply_chat_template(t, add_generation_prompt=True, tokenize=True)
        rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)  # (a BatchEncoding in 5)
        assert by_prompt[t[-1]["content"]] == rendered
