"""How stages load models (stages/common/model_loading.py): `loading.trust_remote_code` runs a
checkpoint's own modelling code only when asked (refused otherwise, naming the knob), and
`loading.attn_implementation` picks transformers' attention kernels; neither enters cache keys."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest
import torch
from typer.testing import CliRunner

from rlpipe.pipelines.cli import app
from rlpipe.schemas import read_manifest
from rlpipe.stages.common.model_loading import ModelLoading, loading
from rlpipe.stages.common.models import clear_cache, load_model

# The checkpoint's own code: a Llama under a model type transformers does not ship. Importing it
# leaves a marker, so the test sees whether it ran.
CONFIGURATION = """\
from pathlib import Path
from transformers import LlamaConfig

Path({marker!r}).touch()


class TinyCustomConfig(LlamaConfig):
    model_type = "tinycustom"
"""
MODELING = """\
from transformers import LlamaForCausalLM

from .configuration_tinycustom import TinyCustomConfig


class TinyCustomForCausalLM(LlamaForCausalLM):
    config_class = TinyCustomConfig
"""


def _custom_code_checkpoint(policy: Path, out: Path, marker: Path) -> Path:
    shutil.copytree(policy, out)
    config = json.loads((out / "config.json").read_text())
    config |= {"model_type": "tinycustom", "architectures": ["TinyCustomForCausalLM"],
               "auto_map": {"AutoConfig": "configuration_tinycustom.TinyCustomConfig",
                            "AutoModelForCausalLM": "modeling_tinycustom.TinyCustomForCausalLM"}}
    (out / "config.json").write_text(json.dumps(config))
    (out / "configuration_tinycustom.py").write_text(CONFIGURATION.format(marker=str(marker)))
    (out / "modeling_tinycustom.py").write_text(MODELING)
    return out


def _rollout(tmp_path: Path, checkpoint: Path, name: str, *extra: str):
    if not (tmp_path / "prompts").exists():
        (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
        assert CliRunner().invoke(app, ["data", "import", str(tmp_path / "p.jsonl"), str(tmp_path / "prompts")]).exit_code == 0
    return CliRunner().invoke(app, ["stage", "rollout", f"checkpoint={checkpoint}", f"prompts={tmp_path / 'prompts'}",
                                    f"output={tmp_path / name}", "max_new_tokens=4", "group_size=2", *extra])


def test_remote_code_runs_only_when_trusted_and_samples_as_the_architecture_it_wraps(tmp_path, tiny_policy_dir):
    marker = tmp_path / "code-ran"
    custom = _custom_code_checkpoint(tiny_policy_dir, tmp_path / "custom", marker)
    refused = _rollout(tmp_path, custom, "refused")
    assert refused.exit_code == 2, refused.output
    assert ("set model.loading.trust_remote_code=true (a stage run alone: loading.trust_remote_code=true)"
            in refused.output.replace("\n", " "))
    assert not marker.exists() and not (tmp_path / "refused").exists()

    trusted = _rollout(tmp_path, custom, "trusted", "loading.trust_remote_code=true")
    assert trusted.exit_code == 0, trusted.output
    assert marker.exists()  # its code ran
    plain = _rollout(tmp_path, tiny_policy_dir, "plain")
    assert plain.exit_code == 0, plain.output
    # the same weights under the checkpoint's own class: the same samples, bit for bit
    columns = ["prompt_id", "sample_index", "response_token_ids", "response_logprobs"]
    ours, theirs = (pl.read_parquet(tmp_path / name / "*.parquet").select(columns).sort(["prompt_id", "sample_index"])
                    for name in ("trusted", "plain"))
    assert ours.equals(theirs)
    recorded = read_manifest(tmp_path / "trusted").config["loading"]
    assert recorded == {"trust_remote_code": True, "attn_implementation": None}


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_attn_implementation_is_the_loaded_models_and_keys_the_model_cache(tiny_policy_dir, implementation):
    clear_cache()
    with loading(ModelLoading(attn_implementation=implementation)):
        model, _ = load_model(tiny_policy_dir)
        assert load_model(tiny_policy_dir)[0] is model  # cached under this setting
    assert model.config._attn_implementation == implementation
    with loading(ModelLoading(attn_implementation="eager" if implementation == "sdpa" else "sdpa")):
        other, _ = load_model(tiny_policy_dir)
    assert other is not model  # another setting: another model, never the cached one
    # the same math: eager and sdpa attention agree to fp32 rounding (a few ulps of the logits)
    ids = torch.tensor([[3, 7, 11, 5, 9, 2]])
    with torch.no_grad():
        a, b = model(ids).logits, other(ids).logits
    assert torch.allclose(a, b, rtol=0, atol=1e-5 * a.abs().max().item())
    clear_cache()


def test_preset_model_loading_reaches_every_model_stage_outside_the_cache_key(tmp_path):
    from rlpipe.pipelines.layout import RunLayout
    from rlpipe.pipelines.plan import Plan
    from rlpipe.pipelines.preset import load_preset

    def rollout_config(*overrides):
        plan = Plan(load_preset("grpo", list(overrides)), RunLayout(tmp_path))
        return plan.call("rollout", tmp_path, checkpoint=tmp_path / "a", prompts=tmp_path / "b", output=tmp_path / "c",
                         run="x", iteration=0, policy_version=0).config

    eager = rollout_config("model.loading.attn_implementation=eager")
    assert eager.loading == ModelLoading(attn_implementation="eager")
    assert "loading" not in eager.cache_dict() and eager.cache_dict() == rollout_config().cache_dict()
    # a stage's own setting wins over the preset's
    own = rollout_config("model.loading.attn_implementation=eager", "rollout.loading.attn_implementation=sdpa")
    assert own.loading.attn_implementation == "sdpa"


def test_preset_model_dtype_reaches_optimize_and_every_frozen_role_in_the_cache_key(tmp_path):
    """`model.dtype`: optimize trains in it and the rollout, the evaluation, the reference and
    each reward-model score component load in it, a stage's own `dtype` winning; it is what they
    compute, so it is in their cache keys. import_model's `dtype` (what it saves) is another knob."""
    from rlpipe.pipelines.layout import RunLayout
    from rlpipe.pipelines.plan import Plan
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.stages.rollout.config import RolloutConfig

    def calls(*overrides):
        plan = Plan(load_preset("grpo", ["model.reward_model=rm", "model.reference=true",
                                          "score.components=[{name: rm, type: reward_model}]", *overrides]),
                    RunLayout(tmp_path))
        return {name: plan.call(name, tmp_path, **fields).config for name, fields in {
            "rollout": dict(checkpoint=tmp_path / "a", prompts=tmp_path / "b", output=tmp_path / "c", run="x",
                            iteration=0, policy_version=0),
            "evaluate": dict(checkpoint=tmp_path / "a", prompts=tmp_path / "b", output=tmp_path / "e"),
            "reference": dict(rollouts=tmp_path / "r", output=tmp_path / "f", reference_model=tmp_path / "a"),
            "optimize": dict(policy=tmp_path / "a", rollouts=tmp_path / "r", advantages=tmp_path / "v",
                             output=tmp_path / "o", metrics_output=tmp_path / "m"),
            "score": dict(rollouts=tmp_path / "r", output=tmp_path / "s", **plan._score_components()),
        }.items()}

    auto, bf16 = calls(), calls("model.dtype=bf16")
    for name, config in bf16.items():
        dtypes = ([c.dtype for c in config.components if c.type == "reward_model"] if name == "score"
                  else [config.dtype])
        assert dtypes and set(dtypes) == {"bf16"}, name
        assert config.cache_dict() != auto[name].cache_dict(), name
    assert {auto["rollout"].dtype, auto["optimize"].dtype} == {"auto"}
    assert calls("model.dtype=bf16", "rollout.dtype=fp32")["rollout"].dtype == "fp32"  # a stage's own wins
    legacy = RolloutConfig(checkpoint=tmp_path / "a", prompts=tmp_path / "b", output=tmp_path / "o", dtype="bfloat16")
    assert legacy.dtype == "bf16"  # (vLLM's names, as the rollout knob took them before)


def test_a_checkpoint_loaded_in_two_dtypes_is_two_models(tiny_policy_dir):
    from rlpipe.stages.common.models import clear_cache

    clear_cache()
    fp32, _ = load_model(tiny_policy_dir)
    bf16, _ = load_model(tiny_policy_dir, dtype=torch.bfloat16)
    assert bf16 is not fp32 and load_model(tiny_policy_dir, dtype=torch.bfloat16)[0] is bf16
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert all(torch.equal(a.to(torch.bfloat16), b) for a, b in zip(fp32.parameters(), bf16.parameters(), strict=True))
    clear_cache()
