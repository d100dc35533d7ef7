"""Presets: every built-in one loads, and bad knobs are reported by stage and key before any work."""

from pathlib import Path

import pytest
import yaml

from rlpipe.pipelines.preset import builtin_presets, load_preset
from rlpipe.schemas.config_files import ConfigError


def test_builtin_presets_exist():
    assert {"demo", "demo_lora", "demo_tools", "demo_trpo", "grpo", "ppo", "grpo_rm", "smol", "smol_tools"} == set(builtin_presets())


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


# -- a run directory's saved preset, from this or an earlier release ------------------------------
EARLIER_RELEASE = Path(__file__).parent / "fixtures" / "preset_before_async.yaml"


def _run_cli(*args) -> tuple[int, str]:
    from typer.testing import CliRunner

    from rlpipe.pipelines.cli import app

    result = CliRunner().invoke(app, ["run", *map(str, args)])
    return result.exit_code, result.output


def _manifests(run_dir: Path) -> dict[str, int]:
    """Every manifest of the run and when it was written (a recomputed stage rewrites its own)."""
    return {str(p.relative_to(run_dir)): p.stat().st_mtime_ns for p in run_dir.rglob("_manifest.json")}


def _saved(run_dir: Path, text: str) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "preset.yaml").write_text(text)
    return run_dir / "preset.yaml"


@pytest.mark.integration
def test_a_run_an_earlier_release_started_resumes_and_extends(tmp_path):
    """The fixture is runs/<run>/preset.yaml as rlpipe wrote it before `async:` existed (the
    shortened demo): today's rlpipe resumes that run (every finished stage a cache hit) and
    extends it by 2 iterations, instead of refusing it as 'differs in async'."""
    run_dir = tmp_path / "runs" / "demo"
    code, out = _run_cli(EARLIER_RELEASE, "--local", "--run-dir", run_dir)
    assert code == 0, out
    _saved(run_dir, EARLIER_RELEASE.read_text())  # the run as the earlier release left it
    finished = _manifests(run_dir)
    assert "iter_0000/eval/_manifest.json" in finished and not (run_dir / "iter_0001").exists()

    code, out = _run_cli(EARLIER_RELEASE, "--local", "--run-dir", run_dir)  # resume
    assert code == 0, out
    assert _manifests(run_dir) == finished  # nothing recomputed

    code, out = _run_cli(EARLIER_RELEASE, "--local", "--run-dir", run_dir, "iterations=3")  # extend
    assert code == 0, out
    after = _manifests(run_dir)
    assert {k: after[k] for k in finished} == finished
    assert {"iter_0001/eval/_manifest.json", "iter_0002/eval/_manifest.json"} <= set(after)
    saved = yaml.safe_load((run_dir / "preset.yaml").read_text())  # rewritten as today's rlpipe reads it
    assert saved["iterations"] == 3 and saved["async"] == {"staleness": 0}


@pytest.mark.parametrize(("line", "key"), [("warp_speed: 9", "warp_speed"),
                                           ("  warp_factor: 9", "warp_factor")])
def test_a_saved_preset_with_a_key_this_rlpipe_does_not_know_is_refused(tmp_path, line, key):
    """A key today's rlpipe does not know (at the top, or a knob of the optimize stage) was written
    by another version, or by hand: the run is refused before any stage, naming the key."""
    text = EARLIER_RELEASE.read_text()
    text = text + line + "\n" if not line.startswith(" ") else text.replace("optimize:\n", f"optimize:\n{line}\n")
    run_dir = tmp_path / "runs" / "demo"
    saved = _saved(run_dir, text)
    code, out = _run_cli(EARLIER_RELEASE, "--local", "--run-dir", run_dir)
    assert code == 2, out
    assert "Traceback" not in out and out.count("error:") == 1 and len(out.strip().splitlines()) == 1, out
    assert f"unknown key '{key}'" in out and str(saved) in out and "different preset" in out, out
    if key == "warp_factor":
        assert "(optimize)" in out, out
    assert sorted(p.name for p in run_dir.iterdir() if not p.name.startswith(".")) == ["preset.yaml"]


def test_saved_presets_are_compared_by_meaning(tmp_path):
    """Keys added since with their defaults, and knobs left at a stage's default, are the same run;
    a knob that changes what is computed is not, and is named."""
    from rlpipe.pipelines.saved_preset import preset_differences

    saved = _saved(tmp_path / "runs" / "demo", EARLIER_RELEASE.read_text())
    today = load_preset(EARLIER_RELEASE)
    assert "async" not in yaml.safe_load(saved.read_text())
    assert preset_differences(saved, today) == []
    assert preset_differences(saved, load_preset(EARLIER_RELEASE, ["iterations=30", "keep.tables=false"])) == []
    assert preset_differences(saved, load_preset(EARLIER_RELEASE, ["optimize.epochs=2", "seed=1"])) == ["optimize", "seed"]
    assert preset_differences(saved, load_preset(EARLIER_RELEASE, ["async.staleness=1"])) == ["async"]
    assert preset_differences(saved, load_preset(EARLIER_RELEASE, ["data.task.n_train=41"])) == ["data.task"]
    # a stage knob at its default, written out or left out: the same stage config
    data = yaml.safe_load(EARLIER_RELEASE.read_text())
    assert data["optimize"]["epochs"] == 1 and data["advantage"]["estimator"]["name"] == "grpo"
    data["optimize"].pop("epochs")
    data["advantage"]["estimator"] = "grpo"
    _saved(saved.parent, yaml.safe_dump(data))
    assert preset_differences(saved, today) == []


def test_a_reward_model_run_saved_before_preferences_kind_was_explicit_is_the_same_run(tmp_path):
    """grpo_rm once left `preferences.kind` at its default (answers); it now says it. A run saved
    with the implicit kind is the same run."""
    from rlpipe.pipelines.saved_preset import preset_differences

    today = load_preset("grpo_rm")
    data = today.model_dump(mode="json")
    assert data["preferences"] == {"kind": "answers", "wrong": "zero_padded"}
    data["preferences"] = {"wrong": "zero_padded"}
    del data["async"]
    saved = _saved(tmp_path / "runs" / "grpo_rm", yaml.safe_dump(data, sort_keys=False))
    assert preset_differences(saved, today) == []
    assert preset_differences(saved, load_preset("grpo_rm", ["preferences.wrong=near_miss"])) == ["preferences"]


def test_a_gguf_base_model_is_imported_into_the_run_first(tmp_path):
    """model.base naming a .gguf file: the set-up imports it (its dtype from the preset's
    import_model section) into runs/<run>/models/base, and every stage reads that checkpoint."""
    from rlpipe.pipelines.layout import RunLayout
    from rlpipe.pipelines.plan import Plan

    gguf = tmp_path / "SmolLM2.Q4_1.gguf"
    preset = load_preset("grpo", [f"model.base={gguf}", "import_model.dtype=float32", "sft=null"])
    layout = RunLayout(tmp_path / "runs" / "grpo")
    plan = Plan(preset, layout)
    setup = plan.setup()
    [imported] = [c for c in setup if c.name == "import_model"]
    assert (imported.config.source, imported.config.output, imported.config.dtype) == (gguf, layout.model("base"), "float32")
    assert [c.name for c in setup].index("import_model") < [c.name for c in setup].index("evaluate")
    assert "base_model" not in [c.name for c in setup]
    rollout = plan.iteration(0)[0]
    assert rollout.name == "rollout" and rollout.config.checkpoint == layout.model("base")
    # a checkpoint directory stays as it is
    assert Plan(load_preset("grpo", [f"model.base={tmp_path}", "sft=null"]), layout).base_policy() == tmp_path


def test_your_prompts_on_the_command_line_replace_a_builtin_presets_task(tmp_path, tiny_policy_dir):
    """`rlpipe run grpo model.base=CKPT data.prompts=FILE`: the preset's generated task goes (no
    `data.task=null` needed); set together with data.task, both stay and the preset says so."""
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.schemas.config_files import ConfigError

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    preset = load_preset("grpo", [f"model.base={tiny_policy_dir}", f"data.prompts={prompts}"])
    assert preset.data.task is None and preset.data.prompts == prompts
    assert load_preset("grpo").data.task is not None  # (the preset itself unchanged)
    with pytest.raises(ConfigError, match="set exactly one of data.task"):
        load_preset("grpo", [f"model.base={tiny_policy_dir}", f"data.prompts={prompts}", "data.task.n_train=10"])
