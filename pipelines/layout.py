"""The run directory: where every artifact of a run lives.

    runs/<run>/
      preset.yaml                   the resolved preset the run was started with
      data/prompts_train/           prompts artifact (training prompts)
      data/prompts_eval/            prompts artifact (held-out prompts)
      data/preferences/             preferences artifact (reward-model training, when used)
      models/base/                  base policy checkpoint (the demo builds one locally)
      models/sft/                   SFT warm start (when configured)
      models/reward/                reward model (when trained by the pipeline)
      models/critic/                initial critic (PPO)
      eval_0000/                    evaluation of the starting policy
      iter_0000/
        rollouts/ scores/ reference/ advantages/    table artifacts
        policy/ critic/                             checkpoints written by optimize
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
