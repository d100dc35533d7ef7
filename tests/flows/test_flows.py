"""The Prefect flows run for real, on Prefect's test harness (a temporary local API)."""

import json

import pytest

from rlpipe.flows.settings import configure

configure()


@pytest.fixture(scope="module")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.mark.integration
@pytest.mark.slow
def test_run_flow_and_stage_flow_under_prefect(prefect_harness, mini_preset_file, tmp_path):
    from prefect.client.orchestration import get_client

    from rlpipe.flows.run_flow import run_flow, stage_flow
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.schemas import read_manifest

    preset = load_preset(mini_preset_file, ["iterations=1"])
    run_dir = tmp_path / "runs" / "mini"
    state = run_flow(preset, str(run_dir), return_state=True)
    assert state.is_completed(), state
    # rlpipe's own loggers reach the run's logs in Prefect's UI (its extra loggers): the SFT
    # stage's summary, logged in its task run by `rlpipe.stages.sft.run`
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # (records are sent in batches)
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    sft = [log.message for log in logs if log.name == "rlpipe.stages.sft.run"]
    assert len(sft) == 1 and sft[0].startswith("sft: ") and " steps on " in sft[0], [(g.name, g.message) for g in logs]
    assert read_manifest(run_dir / "iter_0000/policy").kind == "checkpoint"
    assert (run_dir / "report/curves.png").is_file()

    # one stage alone on saved artifacts, as a flow: reproduces the run's artifact
    from rlpipe.schemas.config_files import load_config
    from rlpipe.stages.score.config import ScoreConfig

    # the saved YAML's paths are relative to its folder: load_config resolves them
    config = load_config(ScoreConfig, run_dir / "iter_0000/configs/score.yaml",
                         [f"output={tmp_path / 'rescored'}"]).resolved()
    result = stage_flow("score", config)
    assert result["content_hash"] == read_manifest(run_dir / "iter_0000/scores").content_hash

    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterId,
    )

    from rlpipe.pipelines.report import run_table

    with get_client(sync_client=True) as client:
        # the per-iteration summary as a table artifact: the report's numbers
        [table] = client.read_latest_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["mini-iterations"])))
        assert table.type == "table" and json.loads(table.data) == run_table(run_dir).to_dicts()
        [progress] = client.read_latest_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["mini-progress"])))
        assert progress.type == "progress" and progress.data == 100.0
        assert progress.description == "iteration 1/1: optimize done"
        # the data flow within the iteration, as task dependencies recorded by the API
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    name = {r.id: r.name.rsplit("-", 1)[0] for r in runs}  # "score[iter_0000]-a1b" -> "score[iter_0000]"
    # every recorded input (wait_for and the parameters), as the UI draws them
    upstream = {name[r.id]: {name[i.id] for key, inputs in r.task_inputs.items() if key != "__parents__"
                             for i in inputs} for r in runs}
    assert upstream == {
        "task[task]": set(),  # the set-up stages: prompts, the tiny base model, SFT
        "base_model[models]": set(),
        "sft[models]": {"base_model[models]", "task[task]"},
        "evaluate[mini]": {"sft[models]", "task[task]"},  # eval_0000: the starting policy on held-out prompts
        "rollout[iter_0000]": {"sft[models]", "task[task]"},
        "score[iter_0000]": {"rollout[iter_0000]"},
        "advantage[iter_0000]": {"score[iter_0000]"},
        "optimize[iter_0000]": {"sft[models]", "rollout[iter_0000]", "advantage[iter_0000]"},
        "evaluate[iter_0000]": {"optimize[iter_0000]", "task[task]"},
    }
