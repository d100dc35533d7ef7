"""`rlpipe submit k8s`: the driver Job with its RBAC and the per-stage Jobs (a 2-node optimize
Indexed Job, a 4-worker rollout) pass schema validation by kubernetes-validate (the Kubernetes
OpenAPI schemas, bundled offline, strict: unknown fields fail)."""

from __future__ import annotations

import pytest
import yaml

#: A placement for a cluster of GPU nodes.
PLACEMENT = {"launcher": "kubernetes", "rollout": {"workers": 4, "gpus_per_worker": 1},
             "optimize": {"nodes": 2, "ranks_per_node": 8, "gpus_per_node": 8},
             "kubernetes": {"image": "reg.example/rlpipe:0.1", "namespace": "rl", "pvc": "runs-rwx"}}


def test_submit_k8s_renders_valid_driver_rbac_and_stage_jobs(tmp_path, launched_preset):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    from typer.testing import CliRunner

    from rlpipe.pipelines.cli import app

    preset = launched_preset(tmp_path / "mini.yaml", PLACEMENT)
    result = CliRunner().invoke(app, ["submit", "k8s", str(preset), "--out", str(tmp_path / "k8s")])
    assert result.exit_code == 0, result.output
    files = sorted((tmp_path / "k8s").rglob("*.yaml"))
    assert [p.relative_to(tmp_path / "k8s").as_posix() for p in files] == [
        "driver.yaml", "stages/iter_0000-optimize.yaml", "stages/iter_0000-rollout.yaml"]
    docs = {p.name: list(yaml.safe_load_all(p.read_text())) for p in files}
    version = kubernetes_validate.utils.latest_version()
    for objects in docs.values():
        for obj in objects:
            # raises ValidationError naming the field; strict: a misspelt or misplaced key fails
            kubernetes_validate.validate(obj, version, strict=True)

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
