"""A 2-iteration mini run shared by the report, inspect and sink tests (read-only for them)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from conftest import MINI


@dataclass
class MiniRun:
    run_dir: Path
    records: list
    lines: list[str]
    #: report/index.html as it was right after each iteration (while the run was going).
    pages_during_run: list[str] = field(default_factory=list)


@pytest.fixture(scope="session")
def mini_run(tmp_path_factory) -> MiniRun:
    """The MINI preset (SFT, then 2 GRPO iterations) run by the plain-Python pipeline with every
    metric sink: TensorBoard, MLflow (SQLite store in the run) and W&B offline."""
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.pipelines.runner import Pipeline

    root = tmp_path_factory.mktemp("mini_run")
    preset_file = root / "mini.yaml"
    preset_file.write_text(yaml.safe_dump({**MINI, "loggers": ["tensorboard", "mlflow", "wandb"]}))
    saved = {k: os.environ.get(k) for k in ("WANDB_MODE", "MLFLOW_TRACKING_URI", "WANDB_SILENT")}
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # the default: a store inside the run directory
    try:
        run = MiniRun(root / "runs" / "mini", [], [])
        pipeline = Pipeline(load_preset(preset_file), run.run_dir, log=run.lines.append)
        def page_during_run(record) -> None:
            pipeline.monitor.wait_live()  # (rendered by a thread while the next iteration runs)
            run.pages_during_run.append((run.run_dir / "report" / "index.html").read_text())

        pipeline.on_iteration = page_during_run
        run.records = pipeline.run()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return run
