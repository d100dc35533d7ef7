"""The Prefect flows run for real, on Prefect's test harness (a temporary local API)."""

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
    assert read_manifest(run_dir / "iter_0000/policy").kind == "checkpoint"
    assert (run_dir / "report/curves.png").is_file()

    # one stage alone on saved artifacts, as a flow: reproduces the run's artifact
    import yaml

    config = yaml.safe_load((run_dir / "iter_0000/configs/score.yaml").read_text())
    config["output"] = str(tmp_path / "rescored")
    result = stage_flow("score", config)
    assert result["content_hash"] == read_manifest(run_dir / "iter_0000/scores").content_hash

    # the iteration's metrics table was published as a Prefect artifact
    with get_client(sync_client=True) as client:
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

        arts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["mini-iter-0000"])))
    assert arts and "reward_mean" in arts[0].data
