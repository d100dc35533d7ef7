"""Where a launched stage's output goes: runs/<run>/logs/<iteration or setup>/ (`log_dir`), one
file per process of a call that writes apart from the others (`stage_log`). A resident group's
own output (start-up, between orders) goes to runs/<run>/logs/workers/ (`rlpipe.cluster.resident`).
"""

from __future__ import annotations

from pathlib import Path

from rlpipe.schemas.runs import iteration_index
from rlpipe.stages import StageCall, get_stage


def log_dir(call: StageCall) -> Path:
    """runs/<run>/logs/<iter_NNNN or setup>/ for a call whose configs live in
    runs/<run>/[iter_NNNN/]configs/."""
    where = call.config_dir.absolute().parent
    if iteration_index(where.name) is not None:
        return where.parent / "logs" / where.name
    return where / "logs" / "setup"


def stage_log(logs: Path, stage: str, worker: int, workers: int) -> Path:
    """Where worker (or member) `worker` of `workers` writes its output of one call, in `logs`:
    `<stage>.<i>.log` per worker of a 'shards' stage on several workers, else one `<stage>.log`
    (the ranks of a job share it)."""
    if get_stage(stage).scaling == "shards" and workers > 1:
        return logs / f"{stage}.{worker}.log"
    return logs / f"{stage}.log"
