"""Presets: every built-in one loads, and bad knobs are reported by stage and key before any work."""

import pytest

from rlpipe.pipelines.preset import builtin_presets, load_preset
from rlpipe.schemas.config import ConfigError


def test_builtin_presets_exist():
    assert {"demo", "grpo", "ppo", "grpo_rm"} <= set(builtin_presets())


@pytest.mark.parametrize("name", ["demo", "grpo", "ppo", "grpo_rm"])
def test_builtin_preset_loads_and_every_stage_config_validates(name):
    preset = load_preset(name)
    assert preset.name == name
    assert preset.iterations >= 1


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
