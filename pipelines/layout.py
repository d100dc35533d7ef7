"""The run directory: where every artifact of a run lives (the plan, `plan.py`, names each path).

    runs/<run>/
      preset.yaml                   the resolved preset the run was started with
      hub.json                      what its Hugging Face Hub ids resolved to (id, revision, commit)
      configs/<stage>.yaml          the exact config of each set-up stage (task, base_model, sft, ...)
      data/task/{train,heldout,sft}/  prompts artifacts of the generated task (stage `task`)
      data/preferences/             preferences artifact (stage `preferences`, when a reward model is trained)
      models/base/                  base policy checkpoint (stage `base_model` when model.base is unset,
                                    `import_model` when it names a .gguf file)
      models/sft/, sft_metrics/     SFT warm start and its loss curve (when configured)
      models/reward/, reward_metrics/  reward model (when trained by the pipeline)
      models/critic/                initial critic (stage `critic_init`, PPO)
      eval_0000/                    evaluation of the starting policy
      iter_0000/
        configs/<stage>.yaml                        the exact config each stage ran with
        rollouts/ scores/ reference/ advantages/    table artifacts
        filtered_scores/                            the kept groups' scores (preset `filter:`)
        policy/ critic/                             checkpoints written by optimize
        train_state/                                optimize's DeepSpeed state (AdamW, fp32 masters, LR)
        metrics/                                    optimize metrics (long format)
        eval/                                       evaluation after this iteration (every k)
      report/                       curves.png, metrics.md

Every directory above is an artifact (a `_manifest.json` written last) or holds artifacts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlpipe.schemas.runs import INITIAL_EVAL_DIR, iteration_dir_name


@dataclass(frozen=True)
class RunLayout:
    root: Path
    """runs/<run>: the run directory."""

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def preset_file(self) -> Path:
        return self.root / "preset.yaml"

    @property
    def hub_record(self) -> Path:
        return self.root / "hub.json"

    def data(self, name: str) -> Path:
        return self.root / "data" / name

    def model(self, name: str) -> Path:
        return self.root / "models" / name

    def iteration(self, k: int) -> Path:
        return self.root / iteration_dir_name(k)

    def stage(self, k: int, name: str) -> Path:
        return self.iteration(k) / name

    def initial_eval(self) -> Path:
        return self.root / INITIAL_EVAL_DIR

    @property
    def report(self) -> Path:
        return self.root / "report"
