"""Presets: every built-in one loads, and bad knobs are reported by stage and key before any work."""

import pytest

from rlpipe.pipelines.preset import builtin_presets, load_preset
from rlpipe.schemas.config import ConfigError


def test_builtin_presets_exist():
    assert {"demo", "demo_lora", "demo_tools", "demo_trpo", "grpo", "ppo", "grpo_rm"} == set(builtin_presets())


def _contains(got, want) -> bool:
    """Every key/value written in `want` (a YAML fragment) is in `got` (a config dumped to JSON)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and all(k in got and _contains(got[k], v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(_contains, got, want))
    if isinstance(got, dict) and isinstance(want, str):  # `loss: gspo` is `loss: {name: gspo}`
        return got.get("name") == want
    return got == want


@pytest.mark.parametrize("name", sorted(builtin_presets()))
def test_builtin_preset_loads_and_every_stage_config_validates(name):
    """Every knob written in the preset file reaches its stage's config with that value (none is
    dropped, renamed or overridden by a default on the way)."""
    from pathlib import Path

    import yaml

    from rlpipe.pipelines.layout import RunLayout
    from rlpipe.pipelines.plan import Plan
    from rlpipe.pipelines.preset import PRESETS_DIR

    raw = yaml.safe_load((PRESETS_DIR / f"{name}.yaml").read_text())
    preset = load_preset(name)
    assert preset.name == name
    assert (preset.iterations, preset.prompts_per_iteration) == (raw["iterations"], raw["prompts_per_iteration"])
    plan = Plan(preset, RunLayout(Path("runs") / name))
    configs = {}  # the first config of each stage the run builds (set-up, then iteration 0)
    for call in [*plan.setup(), *plan.iteration(0)]:
        configs.setdefault(call.name, call.config.model_dump(mode="json"))
    checked = 0
    for stage, cfg in configs.items():
        fragment = raw.get("data", {}).get("task") if stage == "task" else raw.get(stage)
        if stage == "score":  # `checkpoint: reward_model` names the run's own reward model
            fragment = {"components": [{**c, "checkpoint": str(plan.reward_model())} if c.get("checkpoint") == "reward_model"
                                       else c for c in fragment["components"]]}
        for key, value in (fragment or {}).items():
            assert _contains(cfg[key], value), f"{name}: {stage}.{key} = {cfg[key]!r}, the preset says {value!r}"
            checked += 1
    assert checked >= 5, f"{name}: only {checked} stage knobs found"


def test_ppo_preset_uses_gae_critic_and_kl_in_reward():
    p = load_preset("ppo")
    assert p.advantage["estimator"]["name"] == "gae" and p.advantage["kl"]["in_reward"] is True
    assert p.model.critic and p.model.reference and p.rollout["group_size"] == 1


def test_unknown_stage_key_names_stage_and_key():
    with pytest.raises(ConfigError) as e:
        load_preset("grpo", ["rollout.temprature=0.5"])
    msg = str(e.value)
    assert "rollout" in msg and "temprature" in msg and "temperature" in msg  # allowed keys listed


def test_bad_literal_lists_allowed_values():
    with pytest.raises(ConfigError) as e:
        load_preset("grpo", ["advantage.estimator=grpoo"])
    assert "grpoo" in str(e.value) and "rloo" in str(e.value)


def test_algorithm_overrides_replace_or_tune_the_presets_variant():
    assert load_preset("grpo", ["advantage.estimator=rloo"]).advantage["estimator"] == "rloo"
    p = load_preset("ppo", ["advantage.estimator.lam=0.9", "optimize.loss=gspo"])
    assert p.advantage["estimator"] == {"name": "gae", "gamma": 1.0, "lam": 0.9}
    assert p.optimize["loss"] == "gspo"
    with pytest.raises(ConfigError, match="unknown key 'estimator.lam'; allowed keys: eps, name, scale, std"):
        load_preset("grpo", ["advantage.estimator.lam=0.9"])  # grpo has no lambda


def test_pipeline_owned_field_is_rejected():
    with pytest.raises(ConfigError, match="set by the pipeline"):
        load_preset("grpo", ["rollout.output=/tmp/x"])


def test_unknown_preset_lists_builtins():
    with pytest.raises(ConfigError, match="demo"):
        load_preset("nope")


def test_every_stage_declares_its_inputs_and_outputs_once():
    """The registry is the one list of stages; each config marks its inputs and outputs, and a
    preset fragment may set none of the fields the pipeline assigns."""
    from rlpipe.stages import STAGES

    for name, stage in STAGES.items():
        cls = stage.config_class()
        assert cls.output_fields(), f"{name} declares no output"
        assert stage.module == f"rlpipe.stages.{name}"
        for field in cls.pipeline_fields():
            with pytest.raises(ConfigError, match="set by the pipeline"):
                load_preset("ppo", [f"{name if name != 'task' else 'data.task'}.{field}=x"])
