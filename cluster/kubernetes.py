"""A whole run on Kubernetes: a driver Job (with the RBAC it needs) runs the pipeline, and every
stage the preset places runs as an Indexed Job the driver creates, watches and deletes.

    rlpipe submit k8s grpo --out k8s/ launch.kubernetes.image=reg/rlpipe:0.1   # render
    kubectl apply -f k8s/driver.yaml                                          # or --apply

Per placed stage (`job_manifests`): a 'ranks' stage is the one-stage template of
`rlpipe.cluster.submit.render_k8s` (a headless Service and an Indexed Job of `nodes` pods running
torchrun, rendezvous at pod 0); a 'shards' stage is an Indexed Job of `workers` pods, pod i
running worker i (`worker_index=$JOB_COMPLETION_INDEX`); a 'single' stage one pod. Every pod
mounts the runs volume (a ReadWriteMany claim) at the same path as the driver, so the saved
`configs/<stage>.yaml` and the artifacts are where the driver wrote them. The manifest is the
completion signal; a failed Job fails the stage with the tail of its pods' logs.

Resident (`launch.resident`, the default for the stages of the RL iterations): the same Jobs, one
per placed stage for the whole run (`group_manifests`), whose pods run `rlpipe.cluster.worker`
members of the stage's group (`--member $JOB_COMPLETION_INDEX` for 'shards' stages) and take each
iteration's call as a work order from the run volume; their per-call output goes to the run's
logs/ on that volume. The driver deletes them when the run ends (or a call fails) and waits for
their pods' deletion, so a group started after a failure never runs beside them; members on other
pods than the driver's leave by themselves when its heartbeat stops (`launch.driver_timeout_s`). A
failed pod's exit code (137: the OOM killer) and completion index name the member that failed; a
pod without one (evicted, its node lost) was lost.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from rlpipe.cluster.failures import StageLaunchError
from rlpipe.cluster.placed import PlacedLauncher, stage_argv, worker_argv
from rlpipe.cluster.placement import KubernetesSpec, StagePlacement
from rlpipe.cluster.submit import JobSpec, render_k8s
from rlpipe.cluster.workorders import WORKERS_DIR, GroupDir
from rlpipe.stages import StageCall, get_stage

DRIVER_ACCOUNT = "rlpipe-driver"
PRESET_MOUNT = "/etc/rlpipe"


def job_name(call: StageCall) -> str:
    """A DNS-1123 name unique to the stage call: rlpipe-<run>-<iteration>-<stage>[-hash] (at most
    52 characters, so that pod host names `<job>-<index>` stay within 63)."""
    where = call.config_dir.absolute().parent
    base = re.sub(r"[^a-z0-9-]+", "-", f"rlpipe-{where.name}-{call.name}".lower()).strip("-")
    digest = hashlib.sha256(str(call.config_file.absolute()).encode()).hexdigest()[:6]
    return f"{base[:45].rstrip('-')}-{digest}"


def job_manifests(call: StageCall, p: StagePlacement, k: KubernetesSpec, *, force: bool = False,
                  python: str = "python") -> list[dict[str, Any]]:
    """The Kubernetes objects of one placed stage call (see the module doc)."""
    return _manifests(call.name, job_name(call), stage_argv(call, force), p, k, python,
                      lambda n: f" worker_index=$JOB_COMPLETION_INDEX worker_count={n}")


def group_name(group: GroupDir) -> str:
    """A DNS-1123 name for a resident group's Job: rlpipe-<run>-<stage>-<token> (at most 52)."""
    stage, _, token = group.path.name.rpartition("-")
    run = group.path.parent.parent.name
    base = re.sub(r"[^a-z0-9-]+", "-", f"rlpipe-{run}-{stage}".lower()).strip("-")
    return f"{base[:43].rstrip('-')}-{token[:8].lower()}"


def group_manifests(stage: str, group: GroupDir, p: StagePlacement, k: KubernetesSpec,
                    python: str = "python") -> list[dict[str, Any]]:
    """The Kubernetes objects of a placed stage's resident group (see the module doc)."""
    return _manifests(stage, group_name(group), worker_argv(group), p, k, python,
                      lambda n: f" --member $JOB_COMPLETION_INDEX --members {n}")


def _manifests(stage: str, name: str, argv: list[str], p: StagePlacement, k: KubernetesSpec, python: str,
               split: Callable[[int], str]) -> list[dict[str, Any]]:
    """`python -m <argv>` on the stage's pods: torchrun per pod of a 'ranks' stage (with its
    Service), else a pod per worker (pod i gets the arguments `split(N)`)."""
    module, args = argv[1], tuple(argv[2:])
    scaling = get_stage(stage).scaling
    spec = JobSpec(stage=stage, args=args, nodes=p.nodes if scaling == "ranks" else 1,
                   gpus_per_node=p.gpus, ranks_per_node=p.ranks_per_node, job_name=name,
                   cpus_per_task=p.cpus_per_task, workdir=k.runs_mount, image=k.image, namespace=k.namespace,
                   pvc=k.pvc, runs_mount=k.runs_mount, module=module)
    service, job = yaml.safe_load_all(render_k8s(spec))
    if scaling == "ranks":
        return [service, job]
    # One pod per worker: the same pod template, running the module itself instead of torchrun.
    workers = p.workers if scaling == "shards" else 1
    job["spec"]["completions"] = job["spec"]["parallelism"] = workers
    pod = job["spec"]["template"]["spec"]
    del pod["subdomain"]
    (container,) = pod["containers"]
    container["name"] = "worker"
    container["args"] = [f"exec {python} -m {module} {' '.join(args)}{split(workers) if workers > 1 else ''}"]
    return [job]


def driver_manifests(preset, k: KubernetesSpec, python: str = "python") -> list[dict[str, Any]]:
    """ServiceAccount, Role (jobs, services: create/get/watch/delete; pods and pods/log: read),
    RoleBinding, the preset as a ConfigMap, and the driver Job running
    `rlpipe run /etc/rlpipe/preset.yaml --local --run-dir <runs_mount>/<name>` (launcher kubernetes)."""
    data = preset.model_dump(mode="json")
    data["launch"] = {**data["launch"], "launcher": "kubernetes"}
    meta = {"namespace": k.namespace, "labels": {"app.kubernetes.io/name": "rlpipe"}}
    name = re.sub(r"[^a-z0-9-]+", "-", f"rlpipe-{preset.name}".lower()).strip("-")[:52]
    rules = [
        {"apiGroups": ["batch"], "resources": ["jobs"],
         "verbs": ["create", "get", "list", "watch", "delete", "patch"]},
        {"apiGroups": [""], "resources": ["services"], "verbs": ["create", "get", "list", "delete", "patch"]},
        {"apiGroups": [""], "resources": ["pods", "pods/log"], "verbs": ["get", "list", "watch"]},
    ]
    command = f"exec {python} -m rlpipe.pipelines.cli run {PRESET_MOUNT}/preset.yaml --local --run-dir {k.runs_mount}/{preset.name}"
    driver_pod = {
        "serviceAccountName": DRIVER_ACCOUNT,
        "restartPolicy": "Never",
        "containers": [{
            "name": "driver", "image": k.image, "workingDir": k.runs_mount,
            "command": ["bash", "-c"], "args": [command],
            "env": [{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "PYTHONUNBUFFERED", "value": "1"}],
            "resources": {"limits": {"cpu": "1"}},
            "volumeMounts": [{"name": "runs", "mountPath": k.runs_mount},
                             {"name": "preset", "mountPath": PRESET_MOUNT, "readOnly": True}],
        }],
        "volumes": [{"name": "runs", "persistentVolumeClaim": {"claimName": k.pvc}},
                    {"name": "preset", "configMap": {"name": f"{name}-preset"}}],
    }
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": DRIVER_ACCOUNT, **meta}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": DRIVER_ACCOUNT, **meta}, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": DRIVER_ACCOUNT, **meta},
         "subjects": [{"kind": "ServiceAccount", "name": DRIVER_ACCOUNT, "namespace": k.namespace}],
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": DRIVER_ACCOUNT}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-preset", **meta},
         "data": {"preset.yaml": yaml.safe_dump(data, sort_keys=False)}},
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{name}-driver", **meta},
         "spec": {"backoffLimit": 0, "template": {"metadata": {"labels": meta["labels"]}, "spec": driver_pod}}},
    ]


def mounted_run_dir(preset) -> Path:
    """The run folder as the pods see it: <launch.kubernetes.runs_mount>/<preset name>."""
    return Path(preset.launch.kubernetes.runs_mount) / preset.name


def render_run(preset, out: Path, setup: list[StageCall], iteration: list[StageCall]) -> list[Path]:
    """Write <out>/driver.yaml (apply it to start the run) and, for review, <out>/stages/<stage>.yaml:
    the Jobs the driver will create for the placed stages among `setup` and `iteration` (the
    plan's set-up calls and first iteration, in the folder `mounted_run_dir(preset)`)."""
    k = preset.launch.kubernetes
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "driver.yaml"]
    written[0].write_text(yaml.safe_dump_all(driver_manifests(preset, k), sort_keys=False))
    run_dir = mounted_run_dir(preset)
    for call in [*setup, *iteration]:
        p = preset.launch.stages.get(call.name)
        if p is None:
            continue
        if preset.launch.resident and call in iteration:  # one group for the run (its token drawn then)
            docs = group_manifests(call.name, GroupDir(run_dir / WORKERS_DIR / f"{call.name}-token"), p, k)
            path = out / "stages" / f"{call.name}-workers.yaml"
        else:
            docs = job_manifests(call, p, k)
            path = out / "stages" / f"{call.config_dir.parent.name}-{call.name}.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        written.append(path)
    return written


def _kubectl(*args: str, stdin: str | None = None, check: bool = True) -> str:
    done = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


class JobGroup:
    """A resident group's Job (`rlpipe.cluster.resident.Handle`), polled every poll_seconds."""

    def __init__(self, docs: list[dict[str, Any]], k: KubernetesSpec, logs: Path, stage: str):
        self.docs, self.k, self.ns = docs, k, ["--namespace", k.namespace]
        self.name = docs[-1]["metadata"]["name"]
        self.per_member = get_stage(stage).scaling != "ranks"  # (a pod per member, its index the member's)
        self.logs = sorted(logs.glob(f"{stage}.*.log"))  # (none: the pods' own output stays in kubectl logs)
        self._last, self._ended = 0.0, None
        _kubectl("apply", *self.ns, "-f", "-", stdin=yaml.safe_dump_all(docs))

    def ended(self) -> tuple[int | None, int | None] | None:
        if self._ended is None and time.monotonic() - self._last >= self.k.poll_seconds:
            self._last = time.monotonic()
            status = json.loads(_kubectl("get", "job", self.name, *self.ns, "-o", "json")).get("status", {})
            conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
            if conditions.get("Failed") == "True":
                code, index = failed_pod(self.name, self.ns)
                self._ended = (code, index if self.per_member else None)
            elif conditions.get("Complete") == "True":
                self._ended = (0, None)
        return self._ended

    def stop(self, grace: float) -> None:
        """Delete the Job (and Service), then wait until its pods are deleted: a new group of the
        stage never runs beside them."""
        delete_and_wait(self.docs, self.name, self.ns, grace)


def delete_and_wait(docs: list[dict[str, Any]], job: str, ns: list[str], grace: float) -> None:
    """Delete the objects `docs` made, then wait for the pods of Job `job` to be gone (a pod on a
    lost node is never confirmed gone: the wait ends after grace + 60 s; the members' heartbeats
    then tell, `rlpipe.cluster.workorders.wait_gone`)."""
    for doc in docs:
        _kubectl("delete", doc["kind"].lower(), doc["metadata"]["name"], *ns, "--ignore-not-found",
                 f"--grace-period={int(grace)}", "--wait=false", check=False)
    _kubectl("wait", "--for=delete", "pod", "-l", f"job-name={job}", *ns, f"--timeout={int(grace) + 60}s",
             check=False)


def failed_pod(job: str, ns: list[str]) -> tuple[int | None, int | None]:
    """(exit code, completion index) of a failed pod of Job `job`: its container's exit code
    (137 when the OOM killer or a SIGKILL ended it); (None, index) when it has none (evicted, its
    node lost), (None, None) when no failed pod is left to tell."""
    pods = json.loads(_kubectl("get", "pods", "-l", f"job-name={job}", *ns, "-o", "json", check=False) or "{}")
    for pod in pods.get("items", []):
        status = pod.get("status", {})
        if status.get("phase") != "Failed":
            continue
        index = pod.get("metadata", {}).get("annotations", {}).get("batch.kubernetes.io/job-completion-index")
        member = int(index) if index is not None else None
        for container in status.get("containerStatuses", []):
            terminated = container.get("state", {}).get("terminated")
            if terminated and terminated.get("exitCode") is not None:
                return int(terminated["exitCode"]), member
        return None, member
    return None, None


class KubernetesLauncher(PlacedLauncher):
    """Placed stages as Indexed Jobs, from a driver with kubectl and the RBAC of `driver_manifests`."""

    def start_group(self, stage: str, p: StagePlacement, group: GroupDir, members: int, logs: Path) -> JobGroup:
        return JobGroup(group_manifests(stage, group, p, self.launch.kubernetes), self.launch.kubernetes, logs, stage)

    def start(self, call: StageCall, p: StagePlacement, force: bool, logs: Path) -> Path:
        k = self.launch.kubernetes
        docs = job_manifests(call, p, k, force=force)
        name, log = job_name(call), logs / f"{call.name}.log"
        ns = ["--namespace", k.namespace]
        for doc in docs:  # a Job left by a killed driver: start over
            _kubectl("delete", doc["kind"].lower(), doc["metadata"]["name"], *ns, "--ignore-not-found", "--wait=true")
        _kubectl("apply", *ns, "-f", "-", stdin=yaml.safe_dump_all(docs))
        try:
            while True:
                status = json.loads(_kubectl("get", "job", name, *ns, "-o", "json")).get("status", {})
                conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
                if conditions.get("Complete") == "True" or conditions.get("Failed") == "True":
                    break
                time.sleep(k.poll_seconds)
            log.write_text(_kubectl("logs", "-l", f"job-name={name}", *ns, "--prefix", "--tail=-1",
                                    "--all-containers", check=False))
            if conditions.get("Failed") == "True":
                code, index = failed_pod(name, ns)
                member = index if get_stage(call.name).scaling != "ranks" else None
                raise StageLaunchError(call.name, code, log, f"Job {name} failed: {status.get('failed', 0)} pod(s) "
                                       "without an exit code (a lost node, an eviction?)", member, lost=code is None)
        finally:
            delete_and_wait(docs, name, ns, 30)
        return log
