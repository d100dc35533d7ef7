"""`rlpipe submit k8s`: the driver Job with its RBAC and the stage Jobs (a 2-node optimize
Indexed Job, a 4-worker rollout; resident groups for the run by default, one Job per call with
`launch.resident=false`) pass schema validation by kubernetes-validate (the Kubernetes OpenAPI
schemas, bundled offline, strict: unknown fields fail)."""

from __future__ import annotations

import re

import pytest
import yaml

#: A placement for a cluster of GPU nodes.
PLACEMENT = {"launcher": "kubernetes", "rollout": {"workers": 4, "gpus_per_worker": 1},
             "optimize": {"nodes": 2, "ranks_per_node": 8, "gpus_per_node": 8},
             "kubernetes": {"image": "reg.example/rlpipe:0.1", "namespace": "rl", "pvc": "runs-rwx"}}


def _render(tmp_path, launched_preset, placement: dict, out: str) -> dict[str, list[dict]]:
    """`rlpipe submit k8s` of the LAUNCHED preset; every rendered object validated (strict)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    from typer.testing import CliRunner

    from rlpipe.pipelines.cli import app

    preset = launched_preset(tmp_path / f"{out}.yaml", placement)
    result = CliRunner().invoke(app, ["submit", "k8s", str(preset), "--out", str(tmp_path / out)])
    assert result.exit_code == 0, result.output
    files = sorted((tmp_path / out).rglob("*.yaml"))
    docs = {p.relative_to(tmp_path / out).as_posix(): list(yaml.safe_load_all(p.read_text())) for p in files}
    version = kubernetes_validate.utils.latest_version()
    for objects in docs.values():
        for obj in objects:
            # raises ValidationError naming the field; strict: a misspelt or misplaced key fails
            kubernetes_validate.validate(obj, version, strict=True)
    return docs


def test_submit_k8s_renders_resident_worker_jobs(tmp_path, launched_preset):
    """Resident (the default): one Job per placed stage for the run, its pods members of the
    stage's worker group, taking work orders from the run volume."""
    docs = _render(tmp_path, launched_preset, PLACEMENT, "resident")
    assert sorted(docs) == ["driver.yaml", "stages/optimize-workers.yaml", "stages/rollout-workers.yaml"]
    service, optimize = docs["stages/optimize-workers.yaml"]
    assert service["kind"] == "Service" and optimize["spec"]["completions"] == 2
    (c,) = optimize["spec"]["template"]["spec"]["containers"]
    assert "torchrun --nnodes 2 --nproc_per_node 8 --node_rank $JOB_COMPLETION_INDEX" in c["args"][0]
    assert "-m rlpipe.cluster.worker --group /runs/mini/workers/optimize-token" in c["args"][0]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 8}
    (rollout,) = docs["stages/rollout-workers.yaml"]
    assert rollout["spec"]["completions"] == rollout["spec"]["parallelism"] == 4
    (c,) = rollout["spec"]["template"]["spec"]["containers"]
    assert c["args"] == ["exec python -m rlpipe.cluster.worker --group /runs/mini/workers/rollout-token "
                         "--member $JOB_COMPLETION_INDEX --members 4"]
    for job in (optimize, rollout):
        assert len(job["metadata"]["name"]) <= 52 and job["metadata"]["name"].startswith("rlpipe-mini-")
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"])  # DNS-1123


def test_submit_k8s_renders_valid_driver_rbac_and_stage_jobs(tmp_path, launched_preset):
    docs = _render(tmp_path, launched_preset, {**PLACEMENT, "resident": False}, "k8s")
    assert sorted(docs) == ["driver.yaml", "stages/iter_0000-optimize.yaml", "stages/iter_0000-rollout.yaml"]
    docs = {name.rpartition("/")[2]: objects for name, objects in docs.items()}

    sa, role, binding, config_map, driver = docs["driver.yaml"]
    assert [sa["kind"], role["kind"], binding["kind"], config_map["kind"], driver["kind"]] == [
        "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Job"]
    verbs = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert {"create", "get", "watch", "delete"} <= verbs[("batch", "jobs")]
    assert {"get", "watch"} <= verbs[("", "pods")] and "get" in verbs[("", "pods/log")]
    assert binding["subjects"][0]["name"] == sa["metadata"]["name"] == driver["spec"]["template"]["spec"]["serviceAccountName"]
    assert yaml.safe_load(config_map["data"]["preset.yaml"])["launch"]["launcher"] == "kubernetes"
    assert "run /etc/rlpipe/preset.yaml --local --run-dir /runs/mini" in driver["spec"]["template"]["spec"]["containers"][0]["args"][0]

    service, optimize = docs["iter_0000-optimize.yaml"]
    assert service["kind"] == "Service" and optimize["spec"]["completionMode"] == "Indexed"
    assert optimize["spec"]["completions"] == optimize["spec"]["parallelism"] == 2
    (c,) = optimize["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 8} and c["image"] == "reg.example/rlpipe:0.1"
    assert "torchrun --nnodes 2 --nproc_per_node 8 --node_rank $JOB_COMPLETION_INDEX" in c["args"][0]
    assert "-m rlpipe.stages.optimize -c /runs/mini/iter_0000/configs/optimize.yaml" in c["args"][0]

    (rollout,) = docs["iter_0000-rollout.yaml"]
    assert rollout["spec"]["completions"] == rollout["spec"]["parallelism"] == 4
    (c,) = rollout["spec"]["template"]["spec"]["containers"]
    assert c["args"] == ["exec python -m rlpipe.stages.rollout -c /runs/mini/iter_0000/configs/rollout.yaml "
                         "worker_index=$JOB_COMPLETION_INDEX worker_count=4"]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 1} and rollout["metadata"]["namespace"] == "rl"
    assert {"name": "runs", "persistentVolumeClaim": {"claimName": "runs-rwx"}} in rollout["spec"]["template"]["spec"]["volumes"]
    for job in (optimize, rollout):
        assert len(job["metadata"]["name"]) <= 52


def test_an_invalid_manifest_is_caught_by_the_validator():
    """The validator is not a rubber stamp: a misspelt field fails."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    bad = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"},
           "spec": {"completions": 2, "paralelism": 2, "template": {"spec": {"containers": []}}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, kubernetes_validate.utils.latest_version(), strict=True)
