"""A real pretrained model end to end, as a user runs it: SmolLM2-135M-Instruct's GGUF file as
`rlpipe model import` puts it into models/ (the session's import, copied there), `rlpipe run smol
--local iterations=2` (smaller batches and held-out set than the preset's, for time), then
`rlpipe inspect --decode` of its rollouts.

What is checked: the rollouts' prompt ids are the chat template's rendering of each question, token
by token; a response that stopped ends with the model's own end-of-turn token; every reward is the
numeric verifier's verdict on the real model's text; the policy moved; inspect shows the template's
markers."""

from __future__ import annotations

import json
import os
import subprocess

import polars as pl
import pytest
from smollm2 import copy_smollm2
from test_user_errors import RLPIPE, script

from rlpipe.stages.score.verifiers import answer_match

pytestmark = [pytest.mark.real_model, pytest.mark.slow, pytest.mark.integration]

#: `rlpipe run smol` made small enough for the suite (the preset's batches take minutes per iteration).
SMALL = ["prompts_per_iteration=2", "rollout.max_new_tokens=64", "data.task.n_heldout=8", "eval_every=1"]


@pytest.fixture(scope="module")
def smol_run(tmp_path_factory, smollm2_checkpoint):
    cwd = tmp_path_factory.mktemp("smol")
    copy_smollm2(smollm2_checkpoint[0], cwd / "models" / "smollm2-135m-instruct")
    code, said = script("run", "smol", "--local", "iterations=2", *SMALL, cwd=cwd)
    assert code == 0, said
    return cwd


def test_smol_samples_through_the_chat_template_and_scores_the_models_numbers(smol_run, smollm2_tokenizer):
    tok = smollm2_tokenizer
    run = smol_run / "runs" / "smol"
    for k in (0, 1):
        r = pl.read_parquet(run / f"iter_{k:04d}" / "rollouts" / "part-*.parquet")
        s = pl.read_parquet(run / f"iter_{k:04d}" / "scores" / "part-*.parquet")
        assert r.height == 16
        for prompt, ids in zip(r["prompt"], r["prompt_token_ids"], strict=True):
            rendered = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                               add_generation_prompt=True)
            assert ids.to_list() == list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        end = tok.convert_tokens_to_ids("<|im_end|>")
        stopped = r.filter(pl.col("finish_reason") == "stop")
        assert stopped.height > 0 and all(ids[-1] == end for ids in stopped["response_token_ids"].to_list())
        joined = r.join(s, on=["group_id", "sample_index"])
        verdicts = [answer_match(text, answer, "numeric") for text, answer in zip(joined["response"], joined["answer"],
                                                                                 strict=True)]
        assert joined["reward"].to_list() == verdicts
    for eval_dir in (run / "eval_0000", run / "iter_0001" / "eval"):
        scores = pl.read_parquet(eval_dir / "scores" / "part-*.parquet")
        assert scores.height == 8  # greedy, once per held-out question, as the rollout samples them


def test_smol_trains_the_policy_and_inspect_shows_the_template(smol_run):
    from safetensors.torch import load_file

    run = smol_run / "runs" / "smol"
    before = load_file(smol_run / "models" / "smollm2-135m-instruct" / "model.safetensors")
    after = load_file(run / "iter_0001" / "policy" / "model.safetensors")
    moved = [name for name in before if not before[name].float().equal(after[name].float())]
    assert len(moved) > len(before) // 2  # the optimizer stepped (most tensors change; a frozen one would not)
    done = subprocess.run([str(RLPIPE), "inspect", str(run / "iter_0001" / "rollouts"), "-n", "1", "--decode"],
                          cwd=smol_run, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "400"})  # (one line per decoded cell)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert "<|im_start|>user" in said and "<|im_start|>assistant" in said and "<|im_end|>" in said


def test_smol_tools_warm_start_calls_the_calculator_as_its_episodes_lay_it_out(smol_run, smollm2_tokenizer):
    """`rlpipe run smol_tools`: the chat SFT (stages/sft/chat.py) on calculator traces, then GRPO on
    calculator episodes. After the preset's 4 SFT steps the greedy held-out episodes call the
    calculator (the base model, offered it in the system prompt, calls it in 0.16 of them), and a
    call is followed by the tool's result as the template renders a `tool` turn, masked."""
    code, said = script("run", "smol_tools", "--local", "iterations=1", "prompts_per_iteration=2",
                        "rollout.group_size=2", "data.task.n_heldout=8", cwd=smol_run)
    assert code == 0, said
    tok, run = smollm2_tokenizer, smol_run / "runs" / "smol_tools"
    r = pl.read_parquet(run / "eval_0000" / "rollouts" / "part-*.parquet")
    assert r.height == 8
    called = 0
    for ids, mask, turns, metadata in zip(r["response_token_ids"], r["response_mask"], r["turns"], r["metadata"],
                                          strict=True):
        calls = [c for t in turns for c in t["tool_calls"]]
        if not calls:
            continue
        called += 1
        task = json.loads(metadata)
        result = str(task["a"] * task["b"])
        text = tok.decode(ids.to_list())
        assert f"<|im_end|>\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n" in text, text
        reply = [i for i, m in zip(ids.to_list(), mask.to_list(), strict=True) if m == 0]
        assert tok.decode(reply) == f"\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"
    assert called >= 4, f"{called} of 8 greedy episodes called the calculator after the warm start"
