"""Task preferences a pipeline can build locally for reward-model training.

Written as an artifact (a manifest last), so a rerun finds it complete and skips it.
"""

from __future__ import annotations

import random
from pathlib import Path

from rlpipe.schemas import PREFERENCES, exists, write_table_artifact


def synthetic_preferences_for(out: Path, preset) -> Path:
    """Preference pairs for the preset's arithmetic task: the correct answer is chosen, a near
    miss (answer +- 1..3) rejected; prompts come from the training split (skipped if complete)."""
    if exists(out):
        return out
    from rlpipe.pipelines import tasks

    spec = preset.data.task
    if spec is None:
        raise ValueError("the preset trains a reward model but has neither data.preferences nor data.task")
    task = spec.to_task()
    train, _ = tasks.make_splits(task, spec.n_train, spec.n_heldout, preset.seed)
    rng = random.Random(preset.seed)
    rows: dict[str, list] = {"pair_id": [], "prompt": [], "chosen": [], "rejected": [], "margin": []}
    for i, problem in enumerate(train):
        answer = int(problem.answer)
        wrong = answer + rng.choice([-3, -2, -1, 1, 2, 3])
        rows["pair_id"].append(f"{problem.prompt_id}-{i}")
        rows["prompt"].append(problem.prompt)
        rows["chosen"].append(str(answer))
        rows["rejected"].append(str(wrong if wrong >= 0 else answer + 1))
        rows["margin"].append(None)
    write_table_artifact(out, PREFERENCES, rows, stage="task_preferences",
                         config={"task": spec.model_dump(mode="json"), "seed": preset.seed})
    return out
