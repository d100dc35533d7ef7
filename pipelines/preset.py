"""Reading a preset: a built-in one by name (pipelines/presets/<name>.yaml) or a YAML file, with
`key=value` overrides, validated as a `Preset` (`preset_spec.py`: the data, the models, every
stage's knobs) and then against its plan: every stage config of the set-up and of the first
iteration is built, so a typo in `rollout.temprature` is reported before anything runs.
"""

from __future__ import annotations

from pathlib import Path

from rlpipe.pipelines import PRESETS_DIR, builtin_presets
from rlpipe.pipelines.layout import RunLayout
from rlpipe.pipelines.plan import Plan
from rlpipe.pipelines.preset_spec import Preset
from rlpipe.schemas.config_files import ConfigError, apply_overrides, load_yaml, parse_config


def load_preset(name_or_path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Preset:
    """A preset by built-in name (`demo`, `grpo`, ...) or YAML path, with `key=value` overrides;
    every stage fragment is validated against its stage config (see `pipelines.runner`)."""
    path = Path(name_or_path)
    if not path.suffix:
        builtin = PRESETS_DIR / f"{name_or_path}.yaml"
        if not builtin.is_file():
            raise ConfigError(f"no preset named {str(name_or_path)!r}; built-in: {builtin_presets()}")
        path = builtin
    data = apply_overrides(_your_prompts_replace_the_task(load_yaml(path), overrides), list(overrides))
    preset = parse_config(Preset, data, str(path))
    check_preference_source(preset, str(path))
    # Every stage config of the set-up and the first iteration, with the paths of the default run
    # directory (paths only decide which inputs are given): a bad knob fails here.
    Plan(preset, RunLayout(Path("runs") / preset.name), source=str(path)).validate()
    return preset


def _your_prompts_replace_the_task(spec: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """`data.prompts=FILE` on the command line of a preset that generates its prompts (data.task,
    as the built-in ones do) trains on FILE instead: the task goes, unless the overrides set it too."""
    keys = [o.partition("=")[0].strip() for o in overrides]
    given = any(k == "data.prompts" for k in keys) and not any(k == "data.task" or k.startswith("data.task.") for k in keys)
    if given and isinstance(spec.get("data"), dict) and spec["data"].get("task") is not None:
        spec = {**spec, "data": {k: v for k, v in spec["data"].items() if k != "task"}}
    return spec


def check_preference_source(preset: Preset, source: str) -> None:
    """A reward model the run trains learns from pairs the preset names: the user's
    (data.preferences) or, said explicitly, synthetic ones (`preferences.kind`). Pairs made up
    from the prompts without a word would train a reward model on something the user never gave."""
    if preset.trains_reward_model and preset.data.preferences is None and "kind" not in preset.preferences:
        raise ConfigError(
            f"{source}: the reward_model section trains a reward model, but no preference pairs are named: "
            "give yours with data.preferences=FILE (JSONL/CSV/Parquet with prompt, chosen, rejected; or a "
            "`preferences` artifact), or train it on synthetic pairs made from the training prompts' answers "
            "with preferences.kind=answers (preferences.wrong: near_miss or zero_padded)"
        )


