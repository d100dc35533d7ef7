"""What a preset runs: every stage call of a run, with its full config, as a pure function of the
preset and the run directory.

The plan touches no file: the paths each stage reads and writes follow from the run layout
(`layout.py`), so the same plan validates a preset before anything runs (every stage config is
built, with the real paths) and drives the runner. A stage's config is the preset's fragment for
that stage (its knobs) plus the fields the pipeline assigns: the ones the stage config marks as
`Input`, `Output` or `Assigned` (see `rlpipe.schemas.config`).

    set-up:     (import_data | task) -> preferences -> (base_model | import_model) -> sft -> reward_model
                -> critic_init -> evaluate
    iteration:  rollout -> score -> (filter) -> (reference) -> advantage -> optimize -> (evaluate)

Stages whose inputs the preset supplies itself (its own prompts, base model or reward model) are
left out. A `data.*` entry naming a data file (JSONL, CSV, Parquet, a `datasets` directory) rather
than an artifact is imported into runs/<run>/data/ first (`import_data`, cached by the file's
content), and later stages read the imported artifact; so is a model.base naming a .gguf file
(`import_model`, into runs/<run>/models/base).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlpipe.pipelines.layout import RunLayout
from rlpipe.pipelines.preset_spec import Preset
from rlpipe.schemas.config_files import ConfigError
from rlpipe.stages import StageCall, get_stage, stage_config
from rlpipe.stages.import_data.config import ONLY_FOR
from rlpipe.stages.import_data.sources import is_data_file

#: optimize.tis_cap of an asynchronous run (`async.staleness` >= 1) whose preset sets none.
ASYNC_TIS_CAP = 2.0

#: data.<field> -> the run's data/<name> a data file named there is imported into.
IMPORTED = {"prompts": "prompts_train", "eval_prompts": "prompts_eval", "preferences": "preferences"}


class Plan:
    """The stage calls of a preset run in `layout` (see the module docstring)."""

    def __init__(self, preset: Preset, layout: RunLayout, source: str = "preset"):
        self.preset, self.layout, self.source = preset, layout, source
        self.setup_dir = layout.root / "configs"

    def call(self, name: str, config_dir: Path, **assigned: Any) -> StageCall:
        """A stage call: the preset's fragment (with the run's seed, and `model.loading` and
        `model.dtype` for a stage that loads models) plus the assigned fields."""
        fragment = dict(self.preset.fragment(name) or {})
        fields = get_stage(name).config_class().model_fields
        if "seed" in fields:
            fragment.setdefault("seed", self.preset.seed)
        if "loading" in fields:
            fragment.setdefault("loading", self.preset.model.loading.model_dump())
        if name in FOLLOW_MODEL_DTYPE:
            fragment.setdefault("dtype", self.preset.model.dtype)
        return StageCall(name, stage_config(name, fragment, self.source, **assigned), config_dir)

    # -- the artifacts a run starts from ---------------------------------------------------
    def task(self) -> StageCall | None:
        """The task stage (when the preset generates its prompts)."""
        if self.preset.data.task is None:
            return None
        d = self.layout.data("task")
        knobs = self.preset.data.task
        sft = d / "sft" if knobs.get("sft_padded_fraction") or knobs.get("sft_tool_fraction") else None
        return self.call("task", self.setup_dir, train=d / "train", heldout=d / "heldout", sft=sft)

    def imports(self) -> list[StageCall]:
        """An import_data call for each data.prompts / eval_prompts / preferences naming a data file;
        the preset's `import_data` knobs (column names) apply to each, less the other kind's."""
        calls = []
        for field, name in IMPORTED.items():
            path = getattr(self.preset.data, field)
            if path is not None and is_data_file(path):
                kind = "preferences" if field == "preferences" else "prompts"
                knobs = {k: v for k, v in self.preset.import_data.items() if k not in ONLY_FOR[kind]}
                config = stage_config("import_data", knobs, self.source, source=path, **{kind: self.layout.data(name)})
                calls.append(StageCall("import_data", config, self.setup_dir / name))
        return calls

    def _data(self, field: str) -> Path | None:
        """data.<field> as an artifact: where it is imported to when it names a data file."""
        path = getattr(self.preset.data, field)
        return self.layout.data(IMPORTED[field]) if path is not None and is_data_file(path) else path

    def prompts(self) -> tuple[Path, Path, Path]:
        """(training, held-out, SFT) prompts artifacts."""
        task = self.task()
        if task is None:
            train = self._data("prompts")
            assert train is not None  # the preset's validator guarantees one source
            return train, self._data("eval_prompts") or train, train
        c = task.config
        return c.train, c.heldout, c.sft or c.train

    def base_policy(self) -> Path:
        """The base checkpoint: model.base, or where the run builds (base_model) or imports (a
        .gguf file: import_model) it."""
        base = self.preset.model.base
        return base if base is not None and not _is_gguf(base) else self.layout.model("base")

    def start_policy(self) -> Path:
        """The policy the first iteration starts from (after SFT when there is SFT)."""
        return self.layout.model("sft") if self.preset.sft is not None else self.base_policy()

    def reward_model(self) -> Path | None:
        m = self.preset.model
        if m.reward_model is not None or self.preset.reward_model is None:
            return m.reward_model
        return self.layout.model("reward")

    def preferences(self) -> Path:
        return self._data("preferences") or self.layout.data("preferences")

    def reference_model(self) -> Path | None:
        return self.start_policy() if self.preset.model.reference else None

    @property
    def staleness(self) -> int:
        """S of `async: {staleness: S}` (0: synchronous)."""
        return self.preset.asynchronous.staleness

    def policy_before(self, k: int) -> Path:
        """The policy as it is before iteration k, which optimize k trains from: optimize k-1's
        output (the starting policy for k = 0)."""
        return self.layout.stage(k - 1, "policy") if k > 0 else self.start_policy()

    def sampling_policy(self, k: int) -> Path:
        """The policy iteration k's rollout samples from: the one before iteration k-S, optimize
        k-1-S's output (`async`; S = 0: the one iteration k optimises)."""
        return self.policy_before(k - self.staleness) if k >= self.staleness else self.start_policy()

    def critic(self, k: int) -> Path | None:
        """The critic iteration k trains (optimize k-1's); its values at sampling time come from
        `critic(k - S)`, of the sampling policy's iteration."""
        if not self.preset.model.critic:
            return None
        return self.layout.stage(k - 1, "critic") if k > 0 else self.layout.model("critic")

    # -- the calls -------------------------------------------------------------------------
    def setup(self) -> list[StageCall]:
        """Set-up calls in order: data, base model, SFT, reward model, critic, first evaluation."""
        p, L = self.preset, self.layout
        train, heldout, sft_prompts = self.prompts()
        calls = [*self.imports(), *(c for c in (self.task(),) if c is not None)]
        trains_rm = p.trains_reward_model
        if trains_rm and p.data.preferences is None:  # before SFT: pairs the prompts cannot give fail in seconds
            calls.append(self.call("preferences", self.setup_dir, prompts=train, output=self.preferences()))
        if p.model.base is not None and _is_gguf(p.model.base):
            calls.append(self.call("import_model", self.setup_dir, source=p.model.base, output=self.base_policy()))
        if p.model.base is None:
            from rlpipe.stages.task.arithmetic import tokenizer_texts

            task = self.task().config
            calls.append(self.call("base_model", self.setup_dir, output=self.base_policy(),
                                   tokenizer_texts=tokenizer_texts(task.to_task(), tools=task.sft_tool_fraction > 0)))
        if p.sft is not None:
            own, rollout = p.fragment("sft") or {}, p.fragment("rollout") or {}
            follows = {k: rollout[k] for k in SFT_FOLLOWS if k in rollout and k not in own}
            calls.append(self.call("sft", self.setup_dir, base=self.base_policy(), prompts=sft_prompts,
                                   output=L.model("sft"), metrics_output=L.model("sft_metrics"),
                                   run=L.name, iteration=0, **follows))
        if trains_rm:
            calls.append(self.call("reward_model", self.setup_dir, preferences=self.preferences(),
                                   base=self.start_policy(), output=self.reward_model(),
                                   metrics_output=L.model("reward_metrics"), run=L.name))
        if p.model.critic:
            calls.append(self.call("critic_init", self.setup_dir, policy=self.start_policy(), output=self.critic(0)))
        calls.append(self.evaluate(self.setup_dir, checkpoint=self.start_policy(), prompts=heldout,
                                   output=L.initial_eval(), run=L.name, iteration=0))
        return calls

    def iteration(self, k: int) -> list[StageCall]:
        """The calls of RL iteration k (0-based), in order."""
        p, L = self.preset, self.layout
        train, heldout, _ = self.prompts()
        cfgs = L.iteration(k) / "configs"
        rollouts, scores = L.stage(k, "rollouts"), L.stage(k, "scores")
        calls = [
            self._rollout(k, cfgs, train, rollouts),
            self.call("score", cfgs, rollouts=rollouts, output=scores, **self._score_components()),
        ]
        if p.filter is not None:  # dynamic sampling: the advantage stage reads the kept groups' scores
            calls.append(self.call("filter", cfgs, scores=scores, output=L.stage(k, "filtered_scores"),
                                   keep_groups=p.prompts_per_iteration))
            scores = L.stage(k, "filtered_scores")
        reference = None
        if p.model.reference or p.model.critic:
            reference = L.stage(k, "reference")
            calls.append(self.call("reference", cfgs, rollouts=rollouts, output=reference,
                                   reference_model=self.reference_model(),
                                   critic=self.critic(max(0, k - self.staleness))))
        joined = {"rollouts": rollouts, "reference": reference} if reference is not None else {}
        if (p.fragment("rollout") or {}).get("environment"):  # episodes: the advantages see the sampled tokens only
            joined["rollouts"] = rollouts
        calls.append(self.call("advantage", cfgs, scores=scores, output=L.stage(k, "advantages"), **joined,
                               **self._adaptive_kl(k)))
        critic = self.critic(k)
        optimize = dict(policy=self.policy_before(k), rollouts=rollouts, advantages=L.stage(k, "advantages"),
                        reference=reference, critic=critic, output=L.stage(k, "policy"),
                        metrics_output=L.stage(k, "metrics"), run=L.name,
                        critic_output=L.stage(k, "critic") if critic is not None else None)
        # The training state (AdamW moments, fp32 masters, LR schedule, RNG) is saved by every
        # state_every-th iteration, (k + 1) % N == 0, and by the last one; iteration k continues from
        # the last saved one, j = N floor(k / N) - 1, and the optimize runs of j+1..k-1 (`replay`,
        # rerun from their artifacts unless the engine is still warm in this process).
        knobs = p.optimize or {}
        if self.staleness and "tis_cap" not in knobs and knobs.get("recompute_old_logprobs", True):
            # Stale samples: weight each token by min(pi_old / pi_behaviour, C) against the
            # engine's log-probs (docs/algorithms.md#async); the preset may set its own cap or null.
            optimize["tis_cap"] = ASYNC_TIS_CAP
        plain = self.call("optimize", cfgs, **optimize).config
        n = plain.state_every or self.default_state_every()
        saved = n * (k // n) - 1
        evaluates = k == p.iterations - 1 or bool(p.eval_every and (k + 1) % p.eval_every == 0)
        if plain.policy_weights == "with_train_state":
            self._check_policy_weights_in_memory()
            if evaluates:  # (the evaluation reads the policy's files)
                optimize["policy_weights"] = "every_iteration"
        calls.append(self.call("optimize", cfgs, **optimize,
                               train_state=L.stage(saved, "train_state") if saved >= 0 else None,
                               replay=[L.stage(i, "policy") for i in range(saved + 1, k)],
                               train_state_output=L.stage(k, "train_state")
                               if (k + 1) % n == 0 or k == p.iterations - 1 else None))
        if evaluates:
            calls.append(self.evaluate(cfgs, checkpoint=L.stage(k, "policy"), prompts=heldout,
                                       output=L.stage(k, "eval"), run=L.name, iteration=k + 1))
        return calls

    def _check_policy_weights_in_memory(self) -> None:
        """`optimize.policy_weights: with_train_state` leaves the policies between train-state saves
        in memory only: refused where the next rollout would read them from disk."""
        p, launch = self.preset, self.preset.launch
        engine = (p.fragment("rollout") or {}).get("engine", "transformers")
        placed = {stage: launch.placement(stage) is not None for stage in ("rollout", "optimize")}
        why = None
        if self.staleness:
            why = "an asynchronous run (async.staleness > 0) samples from older policies than the one in memory"
        elif (p.fragment("optimize") or {}).get("lora") is not None:
            why = "a LoRA policy's merged weights are written every iteration, not handed over"
        elif not any(placed.values()):
            if engine != "transformers":
                why = ("the vllm engine in the driver's process reads the policy from disk (resident rollout "
                       "members take it over the weight channel)")
        elif not (all(placed.values()) and launch.resident and launch.weight_channel):
            why = ("the rollout reads it from disk unless rollout and optimize both run in the driver's process, "
                   "or both as resident workers with launch.weight_channel")
        if why is not None:
            raise ConfigError(f"{self.source}: optimize.policy_weights: with_train_state needs the next rollout to take "
                              f"the new policy from memory, but {why}; set optimize.policy_weights: every_iteration")

    def default_state_every(self) -> int:
        """Iterations between train-state saves when the preset names none (optimize.state_every):
        a cadence where the optimize engines stay alive between calls (in this process, or on a
        resident group), every iteration where each call launches anew and would replay the runs
        since the last save every time."""
        from rlpipe.stages.optimize.config import DEFAULT_STATE_EVERY

        launch = self.preset.launch
        warm = launch.placement("optimize") is None or launch.resident
        return DEFAULT_STATE_EVERY if warm else 1

    def iteration_stages(self) -> set[str]:
        """The stages the iterations call (evaluate too: the last iteration evaluates); placed, they
        run as resident groups for the whole run."""
        return {c.name for c in self.iteration(0)} | {"evaluate"}

    def _rollout(self, k: int, cfgs: Path, train: Path, rollouts: Path) -> StageCall:
        """Iteration k samples the next slice of the training prompts (wrapping around): the
        rollout's group_count() groups, prompts_per_iteration of them unless it oversamples."""
        p, L = self.preset, self.layout

        def call(offset: int) -> StageCall:
            # policy_version: how many optimize runs the sampling policy has had (k - S: stale by S)
            return self.call("rollout", cfgs, checkpoint=self.sampling_policy(k), prompts=train, output=rollouts,
                             run=L.name, iteration=k, policy_version=max(0, k - self.staleness),
                             num_prompts=p.prompts_per_iteration, prompt_offset=offset)

        first = call(0)
        if first.config.oversample != 1.0 and p.filter is None:
            raise ConfigError(f"{self.source}: rollout.oversample is {first.config.oversample} but there is no "
                              "`filter:` section: every oversampled group would be trained on; add `filter: {}` "
                              "(drop groups whose rewards are all equal) or set rollout.oversample to 1")
        return call(k * first.config.group_count()) if k else first

    def validate(self) -> None:
        """Build every config of the set-up and of the first iteration: bad knobs fail now."""
        self.setup()
        self.iteration(0)

    def check_inputs(self) -> None:
        """Every input the run reads but no stage of it writes (the user's model, prompts,
        preferences) exists and is of the right kind: checked before any stage runs, so a wrong
        path fails in a second, not after SFT."""
        from rlpipe.schemas.errors import UserError
        from rlpipe.schemas.inputs import input_problem

        written: set[Path] = set()
        for call in [*self.setup(), *self.iteration(0)]:
            for name, path in call.config.inputs().items():
                if Path(path) in written:
                    continue
                problem = input_problem(path, call.config.input_kind(name))
                if problem:
                    key = self._preset_key(path)
                    where = f"{key} (read as {call.name}.{name})" if key else f"{call.name}.{name}"
                    todo = f"; set {key} in the preset (or as {key}=PATH after it)" if key else ""
                    raise UserError(f"{self.source}: {where}: {problem}{todo}")
            written.update(Path(p) for p in call.config.outputs().values())

    def _preset_key(self, path: Path | str) -> str | None:
        """The data.* or model.* key of the preset that names `path` (None: the run's own path)."""
        for section in ("data", "model"):
            for key, value in getattr(self.preset, section):
                if isinstance(value, (str, Path)) and Path(value) == Path(path):
                    return f"{section}.{key}"
        return None

    def _adaptive_kl(self, k: int) -> dict[str, Any]:
        """With `advantage.kl.controller: adaptive`, iteration k's `kl.beta` is the `kl_beta_next`
        iteration k-1's advantage stage wrote into its manifest (so the saved config shows it and a
        rerun of the stage alone reproduces it); the preset's `kl.beta` starts iteration 0."""
        kl = dict((self.preset.fragment("advantage") or {}).get("kl") or {})
        if kl.get("controller") != "adaptive" or k == 0:
            return {}
        from rlpipe.schemas.errors import UserError
        from rlpipe.schemas.reading import recorded_manifest

        previous = self.layout.stage(k - 1, "advantages")
        try:
            beta = recorded_manifest(previous).extra["kl_beta_next"]
        except Exception as e:
            raise UserError(f"advantage.kl.controller adaptive: iteration {k} needs kl_beta_next from {previous}, "
                            f"which iteration {k - 1} writes (run it first): {e}") from None
        return {"kl": {**kl, "beta": beta}}

    def evaluate(self, config_dir: Path, **assigned: Any) -> StageCall:
        """An evaluate call that answers the held-out prompts as training samples them: the
        rollout's knobs in EVALUATE_FOLLOWS and the score's first answer_match mode, where the
        evaluate section does not set its own."""
        own = self.preset.fragment("evaluate") or {}
        rollout = self.preset.fragment("rollout") or {}
        follows = {k: rollout[k] for k in EVALUATE_FOLLOWS if k in rollout and k not in own}
        from rlpipe.stages.score.config import AnswerMatchComponent

        default = AnswerMatchComponent.model_fields["mode"].default
        modes = [c.get("mode", default) for c in (self.preset.score or {}).get("components", [])
                 if c.get("type") == "answer_match"]
        if modes and "match" not in own:
            follows["match"] = modes[0]
        return self.call("evaluate", config_dir, **follows, **assigned)

    def _score_components(self) -> dict[str, Any]:
        """The score fragment's components, a `checkpoint: reward_model` made the run's reward model."""
        comps = []
        for c in (self.preset.score or {}).get("components", []):
            c = dict(c)
            if c.get("type") == "reward_model":
                c.setdefault("dtype", self.preset.model.dtype)
                if c.get("checkpoint") in (None, "reward_model"):
                    if self.reward_model() is None:
                        raise ConfigError(f"{self.source}: score component {c.get('name')!r} of type reward_model "
                                          "needs a reward model: set model.reward_model or the reward_model stage")
                    c["checkpoint"] = self.reward_model()
            comps.append(c)
        return {"components": comps} if comps else {}


#: The stages whose `dtype` a preset's `model.dtype` sets (a reward-model score component's too,
#: `_score_components`); import_model's `dtype` is the one its checkpoint is saved in, not this.
FOLLOW_MODEL_DTYPE = ("rollout", "evaluate", "reference", "optimize")

#: The rollout knobs the evaluation follows where the preset's evaluate section is silent.
EVALUATE_FOLLOWS = ("max_new_tokens", "stop", "environment", "engine", "chat_template", "system_prompt")
#: The rollout knobs the SFT warm start follows where the preset's sft section is silent: its
#: examples laid out as the episodes are (stages/sft/chat.py).
SFT_FOLLOWS = ("chat_template", "system_prompt", "environment")


def _is_gguf(path: Path) -> bool:
    """Whether model.base names a GGUF file (imported into the run) rather than a checkpoint."""
    return Path(path).suffix.lower() == ".gguf"
