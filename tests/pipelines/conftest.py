"""A miniature preset: the whole pipeline (SFT, evaluation, 2 GRPO iterations) in seconds."""

from pathlib import Path

import pytest
import yaml

MINI = {
    "name": "mini",
    "seed": 0,
    "iterations": 2,
    "prompts_per_iteration": 4,
    "eval_every": 1,
    "data": {"task": {"kind": "arithmetic", "a_range": [0, 9], "b_range": [0, 9], "ops": ["+"],
                      "n_train": 40, "n_heldout": 10}},
    "model": {"tiny_size": "micro"},
    "sft": {"max_steps": 5, "batch_size": 8, "lr": 3.0e-3},
    "rollout": {"group_size": 4, "max_new_tokens": 3},
    "score": {"components": [{"name": "correct", "type": "answer_match", "mode": "exact"}]},
    "advantage": {"estimator": "grpo"},
    "optimize": {"lr": 1.0e-3, "micro_batch_size": 16},
    "evaluate": {"max_new_tokens": 3},
}


@pytest.fixture
def mini_preset_file(tmp_path) -> Path:
    path = tmp_path / "mini.yaml"
    path.write_text(yaml.safe_dump(MINI))
    return path
