"""The plan chains the optimizer state and the adaptive KL coefficient from iteration to iteration."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpipe.pipelines.layout import RunLayout
from rlpipe.pipelines.plan import Plan
from rlpipe.pipelines.preset import load_preset
from rlpipe.schemas.errors import UserError


def _call(calls, name):
    return next(c for c in calls if c.name == name)


def test_optimize_continues_from_the_previous_iterations_train_state(tmp_path):
    plan = Plan(load_preset("grpo", ["optimize.state_every=1"]), RunLayout(tmp_path / "grpo"))
    first, second = _call(plan.iteration(0), "optimize").config, _call(plan.iteration(1), "optimize").config
    assert first.train_state is None
    assert first.train_state_output == tmp_path / "grpo" / "iter_0000" / "train_state"
    assert second.train_state == first.train_state_output


def test_adaptive_kl_beta_comes_from_the_previous_iterations_manifest(tmp_path):
    from rlpipe.schemas import ADVANTAGES, write_table_artifact

    preset = load_preset("grpo", ["advantage.kl.controller=adaptive", "advantage.kl.target=6", "advantage.kl.beta=0.05"])
    plan = Plan(preset, RunLayout(tmp_path / "run"))
    assert _call(plan.iteration(0), "advantage").config.kl.beta == 0.05
    with pytest.raises(UserError, match="kl_beta_next"):
        plan.iteration(1)  # iteration 0 has not written it
    manifest = write_table_artifact(plan.layout.stage(0, "advantages"), ADVANTAGES,
                                    {c: [] for c in ADVANTAGES.column_names}, stage="advantage")
    extra = {**manifest.extra, "kl_beta_next": 0.050064}
    from rlpipe.schemas.atomic import atomic_write_bytes

    path = Path(plan.layout.stage(0, "advantages")) / "_manifest.json"
    atomic_write_bytes(path, manifest.model_copy(update={"extra": extra}).model_dump_json().encode())
    kl = _call(plan.iteration(1), "advantage").config.kl
    assert (kl.beta, kl.controller, kl.target) == (0.050064, "adaptive", 6.0)
    # a fixed controller ignores it
    fixed = Plan(load_preset("grpo", ["advantage.kl.beta=0.05"]), RunLayout(tmp_path / "run"))
    assert _call(fixed.iteration(1), "advantage").config.kl.beta == 0.05


def test_evaluation_answers_as_the_rollout_generates_unless_told_otherwise(tmp_path):
    """The held-out prompts are answered with the rollout's lengths, stop strings, environment,
    engine, chat template and system prompt and scored with the score's answer_match mode; what the
    evaluate section sets wins."""
    preset = load_preset("demo_tools", ["rollout.system_prompt=Be brief.", "rollout.chat_template=true",
                                        "iterations=1"])
    plan = Plan(preset, RunLayout(tmp_path / "run"))
    first, last = _call(plan.setup(), "evaluate").config, _call(plan.iteration(0), "evaluate").config
    rollout = _call(plan.iteration(0), "rollout").config
    for ev in (first, last):
        assert (ev.max_new_tokens, ev.stop, ev.environment, ev.engine, ev.chat_template, ev.system_prompt, ev.match) \
            == (40, ("</tool_call>",), rollout.environment, "transformers", True, "Be brief.", "exact")
    assert rollout.environment.max_turns == 2
    own = Plan(load_preset("demo_tools", ["evaluate.max_new_tokens=12", "evaluate.match=numeric", "iterations=1"]),
               RunLayout(tmp_path / "own"))
    ev = _call(own.setup(), "evaluate").config
    assert (ev.max_new_tokens, ev.match, ev.stop) == (12, "numeric", ("</tool_call>",))


def test_the_warm_start_lays_examples_out_as_the_rollout_unless_told_otherwise(tmp_path):
    """The SFT follows the rollout's chat template, system prompt and environment (its examples
    laid out as the episodes: stages/sft/chat.py); what the sft section sets wins."""
    preset = load_preset("demo_tools", ["rollout.system_prompt=Be brief.", "rollout.chat_template=true",
                                        "iterations=1"])
    plan = Plan(preset, RunLayout(tmp_path / "run"))
    sft, rollout = _call(plan.setup(), "sft").config, _call(plan.iteration(0), "rollout").config
    assert (sft.chat_template, sft.system_prompt, sft.environment) == (True, "Be brief.", rollout.environment)
    own = Plan(load_preset("demo_tools", ["rollout.system_prompt=Be brief.", "sft.system_prompt=Be kind.",
                                          "sft.chat_template=auto", "iterations=1"]), RunLayout(tmp_path / "own"))
    sft = _call(own.setup(), "sft").config
    assert (sft.chat_template, sft.system_prompt) == ("auto", "Be kind.")
    plain = _call(Plan(load_preset("demo", ["iterations=1"]), RunLayout(tmp_path / "demo")).setup(), "sft").config
    assert (plain.chat_template, plain.system_prompt, plain.environment) == ("auto", None, None)
