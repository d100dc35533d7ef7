"""Config loading: YAML + key=value overrides into frozen pydantic models; errors name the key and
what it allows."""

from pathlib import Path
from typing import Annotated, Literal

import pytest
import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from rlpipe.schemas.config import Input, Output, StageConfig, Variant, name_shorthand
from rlpipe.schemas.config_files import (
    ConfigError,
    apply_overrides,
    describe_fields,
    load_config,
    union_tags,
)


class Sampling(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    temperature: float = Field(1.0, gt=0)
    """Softmax temperature."""
    max_new_tokens: int = Field(16, ge=1)
    """Generation budget."""


class DemoConfig(StageConfig):
    output: Path
    """Where the artifact goes."""
    engine: Literal["transformers", "vllm"] = "transformers"
    """Generation engine."""
    group_size: int = Field(8, ge=1)
    """Samples per prompt."""
    seed: int = 0
    """Seed."""
    sampling: Sampling = Sampling()
    """Sampling parameters."""


def _yaml(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_yaml_then_overrides(tmp_path):
    path = _yaml(tmp_path, "output: runs/x\ngroup_size: 4\nsampling:\n  temperature: 0.7\n")
    cfg = load_config(DemoConfig, path, ["sampling.max_new_tokens=32", "engine=vllm", "seed=3"])
    # A relative path in the file is relative to the file's folder.
    assert cfg.output == tmp_path / "runs/x" and cfg.group_size == 4 and cfg.engine == "vllm" and cfg.seed == 3
    assert cfg.sampling == Sampling(temperature=0.7, max_new_tokens=32)  # nested merge keeps temperature
    assert cfg.resolved() == {"output": str(tmp_path / "runs/x"), "engine": "vllm", "group_size": 4, "seed": 3,
                              "sampling": {"temperature": 0.7, "max_new_tokens": 32}}
    # ... and one given as an override is relative to the current directory.
    assert load_config(DemoConfig, path, ["output=runs/y"]).output == Path("runs/y")
    with pytest.raises(ValidationError, match="frozen"):
        cfg.seed = 4  # type: ignore[misc]
    # later wins: an override beats the file, the file beats `base`
    cfg = load_config(DemoConfig, path, ["group_size=2"], base={"group_size": 16, "seed": 5})
    assert (cfg.group_size, cfg.seed) == (2, 5)


def test_unknown_key_lists_allowed_keys(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(DemoConfig, _yaml(tmp_path, "output: x\ngroupsize: 4\n"))
    msg = str(e.value)
    assert "invalid DemoConfig in" in msg and str(tmp_path / "c.yaml") in msg
    assert "unknown key 'groupsize'; allowed keys: engine, group_size, output, sampling, seed" in msg


def test_unknown_nested_key_lists_the_nested_keys():
    with pytest.raises(ConfigError) as e:
        load_config(DemoConfig, None, ["output=x", "sampling.temprature=0.5"])
    assert "unknown key 'sampling.temprature'; allowed keys: max_new_tokens, temperature" in str(e.value)


def test_bad_literal_lists_allowed_values():
    with pytest.raises(ConfigError) as e:
        load_config(DemoConfig, None, ["output=x", "engine=vlm"])
    msg = str(e.value)
    assert "key 'engine'" in msg and "'transformers' or 'vllm'" in msg and "(got 'vlm')" in msg


def test_wrong_type_and_constraint_name_the_key():
    with pytest.raises(ConfigError) as e:
        load_config(DemoConfig, None, ["output=x", "group_size=many", "sampling.temperature=0"])
    msg = str(e.value)
    assert "key 'group_size': Input should be a valid integer" in msg and "(got 'many')" in msg
    assert "key 'sampling.temperature': Input should be greater than 0 (got 0)" in msg


def test_missing_required_key():
    with pytest.raises(ConfigError, match="missing required key 'output'"):
        load_config(DemoConfig, None, [])


def test_bad_files_and_overrides(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(DemoConfig, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(DemoConfig, _yaml(tmp_path, "output: [x\n"))
    with pytest.raises(ConfigError, match="expected a mapping of keys to values, got list"):
        load_config(DemoConfig, _yaml(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="override 'group_size' is not of the form key=value"):
        load_config(DemoConfig, None, ["group_size"])


def test_override_values_are_yaml():
    out = apply_overrides({"a": {"b": 1}}, ["a.c=[1, 2]", "d=true", "e=0.5", "f=text", "a.b=2"])
    assert out == {"a": {"b": 2, "c": [1, 2]}, "d": True, "e": 0.5, "f": "text"}


def test_describe_fields_flattens_nested_models():
    rows = {k: (t, d, doc) for k, t, d, doc in describe_fields(DemoConfig)}
    assert rows["output"] == ("Path", "required", "Where the artifact goes.")
    assert rows["sampling.temperature"] == ("float", "1.0", "Softmax temperature.")
    assert rows["group_size"][1:] == ("8", "Samples per prompt.")


# ---------------------------------------------------------------------------------------------
# Unions tagged by `name`: each variant owns its knobs; a bare name is shorthand
# ---------------------------------------------------------------------------------------------
class Adam(Variant):
    name: Literal["adam"] = "adam"
    """Name."""
    beta: float = Field(0.9, ge=0, lt=1)
    """Momentum."""


class Sgd(Variant):
    name: Literal["sgd"] = "sgd"
    """Name."""
    momentum: float = 0.0
    """Momentum."""


class TaggedConfig(StageConfig):
    output: Path
    """Where the artifact goes."""
    optimizer: Annotated[Adam | Sgd, Field(discriminator="name"), BeforeValidator(name_shorthand)] = Adam()
    """The optimizer and its knobs."""


def test_tagged_union_shorthand_overrides_and_defaults(tmp_path):
    assert load_config(TaggedConfig, None, ["output=x"]).optimizer == Adam(beta=0.9)
    assert load_config(TaggedConfig, None, ["output=x", "optimizer=sgd"]).optimizer == Sgd()
    assert load_config(TaggedConfig, None, ["output=x", "optimizer.name=sgd", "optimizer.momentum=0.5"]).optimizer == Sgd(momentum=0.5)
    # a mapping without `name` tunes the default variant
    assert load_config(TaggedConfig, None, ["output=x", "optimizer.beta=0.5"]).optimizer == Adam(beta=0.5)
    # a bare name in the file, then a dotted override into it: {name: sgd, momentum: 0.1}
    path = _yaml(tmp_path, "output: x\noptimizer: sgd\n")
    assert load_config(TaggedConfig, path, ["optimizer.momentum=0.1"]).optimizer == Sgd(momentum=0.1)
    # what is saved is the nested form, and it loads back with the same overrides
    saved = load_config(TaggedConfig, None, ["output=x", "optimizer.beta=0.5"]).resolved()
    assert saved["optimizer"] == {"name": "adam", "beta": 0.5}
    path = _yaml(tmp_path, yaml.safe_dump(saved))
    assert load_config(TaggedConfig, path, ["optimizer=sgd"]).optimizer == Sgd()
    assert load_config(TaggedConfig, path, ["optimizer.beta=0.1"]).optimizer == Adam(beta=0.1)


def test_tagged_union_errors_name_the_key_the_user_wrote():
    with pytest.raises(ConfigError) as e:
        load_config(TaggedConfig, None, ["output=x", "optimizer.name=sgd", "optimizer.beta=0.5"])
    assert "unknown key 'optimizer.beta'; allowed keys: momentum, name" in str(e.value)  # not 'optimizer.sgd.beta'
    with pytest.raises(ConfigError) as e:
        load_config(TaggedConfig, None, ["output=x", "optimizer.beta=1.5"])
    assert "key 'optimizer.beta': Input should be less than 1 (got 1.5)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(TaggedConfig, None, ["output=x", "optimizer=lion"])
    assert "key 'optimizer'" in str(e.value) and "'lion'" in str(e.value) and "'adam', 'sgd'" in str(e.value)


def test_describe_fields_lists_each_variants_knobs():
    rows = {(k, doc.split("]")[0]): (t, d) for k, t, d, doc in describe_fields(TaggedConfig)}
    assert rows[("optimizer", "The optimizer and its knobs.")] == ("adam | sgd", "'adam'")
    assert rows[("optimizer.beta", "[name=adam")] == ("float", "0.9")
    assert rows[("optimizer.momentum", "[name=sgd")] == ("float", "0.0")
    assert union_tags(TaggedConfig.model_fields["optimizer"].annotation) == {"adam": Adam, "sgd": Sgd}


def test_algorithm_configs_import_without_torch():
    # The CLI parses configs before heavy imports: the variant classes must live in light modules.
    import subprocess
    import sys

    code = ("import sys, rlpipe.stages.advantage.config, rlpipe.stages.optimize.config, rlpipe.stages.score.config; "
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_file_loaded_again_unchanged_gives_the_config_parsed_first(tmp_path, monkeypatch):
    path = _yaml(tmp_path, "output: runs/x\ngroup_size: 4\n")
    first = load_config(DemoConfig, path)
    assert load_config(DemoConfig, path) is first
    assert load_config(DemoConfig, path, ["seed=1"]).seed == 1 and load_config(DemoConfig, path).seed == 0
    # a rewrite (another file put in its place, same size) is read again
    (tmp_path / "o").mkdir()
    other = _yaml(tmp_path / "o", "output: runs/x\ngroup_size: 5\n")
    other.replace(path)
    assert load_config(DemoConfig, path).group_size == 5
    # a relative override is relative to the current directory: another one, another config
    monkeypatch.chdir(tmp_path)
    here = load_config(DemoConfig, path, ["output=y"])
    monkeypatch.chdir(tmp_path / "o")
    assert load_config(DemoConfig, path, ["output=y"]) is not here


class TwoPaths(StageConfig):
    data: Annotated[Path, Input("rollouts")]
    """An input."""
    output: Annotated[Path, Output("scores")]
    """The output."""


@pytest.mark.parametrize(("data", "output", "overlap"), [
    ("a/b", "a/b", True), ("a/b", "a/b/c", True), ("a/b/c", "a", True), ("a/b", "a/x/../b", True),
    ("a/b", "a/bc", False), ("a/bc", "a/b", False), ("a/b", "a/c", False),
])
def test_an_output_may_not_overlap_an_input(tmp_path, data, output, overlap):
    if overlap:
        with pytest.raises(ConfigError, match="overlaps input 'data'"):
            load_config(TwoPaths, None, [f"data={tmp_path / data}", f"output={tmp_path / output}"])
    else:
        load_config(TwoPaths, None, [f"data={tmp_path / data}", f"output={tmp_path / output}"])


def test_every_trl_name_points_at_a_real_key_and_is_in_the_docs():
    """schemas/trl_names.py names keys that exist (a preset key, or a key of a stage's config
    under its section), and docs/from_trl.md lists every one of them."""
    from rlpipe.pipelines.preset_spec import Preset
    from rlpipe.schemas.trl_names import TRL_NAMES
    from rlpipe.stages import STAGES, get_stage

    doc = (Path(__file__).resolve().parents[1] / "docs" / "from_trl.md").read_text()
    preset_keys = {k for k, *_ in describe_fields(Preset)}
    for trl, (where, _) in TRL_NAMES.items():
        assert f"| `{trl}` | `{where}` |" in doc, f"docs/from_trl.md does not list {trl}"
        if where.startswith("--"):
            continue  # (a command-line option)
        section, _, key = where.partition(".")
        if section in STAGES and key:
            assert key in {k for k, *_ in describe_fields(get_stage(section).config_class())}, where
        else:  # a key, or a section of keys (model.loading)
            assert where in preset_keys or any(k.startswith(f"{where}.") for k in preset_keys), where
