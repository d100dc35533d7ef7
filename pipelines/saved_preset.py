"""Is a run directory's saved preset (runs/<run>/preset.yaml) the same run as the preset given now?

Runs outlive releases: a run started by an older rlpipe wrote its preset without the keys added
since (e.g. `async`), and a built-in preset may now spell out a default it used to leave implicit
(`preferences: {kind: answers}`). So the two are compared by meaning, not by text: the saved file
is read by today's `Preset` (a key added since takes its default), top-level keys are compared
with defaults filled in, and a stage section by the stage configs it gives (each stage's defaults
filled in, the same pipeline-assigned fields on both sides). A key today's rlpipe does not know is
refused with an error naming it: that run was written by another version, or edited.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlpipe.pipelines.layout import RunLayout
from rlpipe.pipelines.plan import Plan
from rlpipe.pipelines.preset_spec import Preset
from rlpipe.schemas.config_files import ConfigError, load_yaml, parse_config
from rlpipe.stages import STAGES

#: Preset keys that never change what a run computes: a run extends or resumes under any value of
#: them (how many iterations, where stages run, where metrics go, what stays on disk).
NOT_THE_RUN = frozenset({"iterations", "launch", "loggers", "description", "keep"})


def preset_differences(saved_file: Path, preset: Preset) -> list[str]:
    """The keys (`optimize`, `data.task`, `seed`, ...) in which the run saved in `saved_file`
    and `preset` differ in meaning, leaving out NOT_THE_RUN; [] means the same run.

    Raises ConfigError, naming the key, when today's rlpipe cannot read the saved preset."""
    layout = RunLayout(saved_file.parent)
    saved = read_saved_preset(saved_file, layout)
    before, now = _top_level(saved), _top_level(preset)
    changed = {k for k in before.keys() | now.keys() if before.get(k) != now.get(k)}
    changed |= {_key(s) for s in STAGES if not _same_stage(s, saved, preset, layout)}
    return sorted(changed)


def read_saved_preset(saved_file: Path, layout: RunLayout) -> Preset:
    """The saved preset as today's `Preset`, every stage section checked against its stage config
    (a knob removed since is an unknown key here, as in a preset file)."""
    try:
        saved = parse_config(Preset, load_yaml(saved_file), str(saved_file))
        Plan(saved, layout, source=str(saved_file)).validate()
    except ConfigError as e:
        raise ConfigError(
            f"{layout.root} holds a run of a different preset: {_one_line(e)} (written by another rlpipe "
            f"version, or edited); resume it with the rlpipe that started it, pass another run directory "
            f"(--run-dir DIR) or delete {layout.root} to start over"
        ) from None
    return saved


def _top_level(preset: Preset) -> dict[str, Any]:
    """The preset's keys other than the stage sections (compared by `_same_stage`) and NOT_THE_RUN,
    with every default filled in."""
    out = preset.model_dump(mode="json")
    out["data"].pop("task")
    return {k: v for k, v in out.items() if k not in NOT_THE_RUN and k not in STAGES}


def _same_stage(stage: str, saved: Preset, preset: Preset, layout: RunLayout) -> bool:
    """Whether the saved section of `stage` means what `preset`'s does: equal as written, or
    giving equal configs of that stage when put into `preset` in place of its own (so only the
    section differs, and each knob left out has the stage's default)."""
    if saved.fragment(stage) == preset.fragment(stage):
        return True
    if stage == "task":
        swapped = preset.model_copy(update={"data": preset.data.model_copy(update={"task": saved.data.task})})
    else:
        swapped = preset.model_copy(update={stage: saved.fragment(stage)})
    try:
        return _stage_configs(swapped, stage, layout) == _stage_configs(preset, stage, layout)
    except ConfigError:  # the saved section does not fit today's other sections: another run
        return False


def _stage_configs(preset: Preset, stage: str, layout: RunLayout) -> list[dict[str, Any]]:
    """The resolved configs of `stage` in the set-up and the first iteration of `preset`."""
    plan = Plan(preset, layout)
    return [c.config.model_dump(mode="json") for c in [*plan.setup(), *plan.iteration(0)] if c.name == stage]


def _key(stage: str) -> str:
    """The preset key of a stage's section."""
    return "data.task" if stage == "task" else stage


def _one_line(error: ConfigError) -> str:
    """A config error on one line, without the lists of allowed keys (which describe today's keys,
    not what to do about a saved file): 'invalid Preset in F: unknown key 'x'; ...'."""
    head, *items = str(error).splitlines()
    problems = [item.strip().removeprefix("- ").split("; allowed keys")[0] for item in items]
    return f"{head.rstrip(':')}: {'; '.join(problems)}" if problems else head
