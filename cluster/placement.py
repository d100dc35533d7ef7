"""Where each stage of a run runs: the preset's `launch` section.

    launch:
      launcher: processes               # local (default) | processes | slurm | kubernetes
      rollout:   {workers: 2}           # 'shards' stages: N worker processes, one artifact
      reference: {workers: 2, gpus_per_worker: 1}
      optimize:  {nodes: 1, ranks_per_node: 2}   # 'ranks' stages: one multi-rank job

A stage named here is launched by the chosen launcher (`rlpipe.cluster.launchers`) as separate
processes that run its saved `configs/<stage>.yaml`; a stage not named here runs in the driver's
process, as with `launcher: local`, where every placement is ignored (so a preset written for a
cluster also runs on a laptop with `launch.launcher=local`). What a stage may ask for follows its
registry entry's `scaling` (`rlpipe.stages.STAGES`): 'shards' stages take `workers` (and
`gpus_per_worker`), 'ranks' stages take `nodes`, `ranks_per_node` (and `gpus_per_node`),
'single' stages one process (and `gpus_per_worker`). Placement never changes what a stage
computes: its artifacts and cache keys are those of the in-process run. On the driver's machine
(`processes`) a stage may name its GPUs (`gpu_ids`), and resident groups that would hold the same
GPU are refused unless `share_gpus` names both (`rlpipe.cluster.gpus`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LauncherName = Literal["local", "processes", "slurm", "kubernetes", "prefect"]
"""local: every stage in the driver's process. processes: placed stages as local processes
(worker processes, torchrun). slurm: placed stages as `srun` steps of the allocation the driver
runs in. kubernetes: placed stages as Indexed Jobs (needs kubectl and a shared volume). prefect:
placed stages with a `work_pool` as runs of the `rlpipe-stage/<pool>` deployment, picked up by
that pool's workers (which start the stage's processes as `processes` would); the others as
`processes`."""

class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class StagePlacement(_Spec):
    """How many processes, nodes and GPUs one stage gets."""

    workers: int = Field(1, ge=1)
    """'shards' stages: worker processes sharing the stage's one output artifact (worker i of N
    writes the shards k with k % N == i; the last to finish writes the manifest)."""
    gpus_per_worker: int = Field(0, ge=0)
    """'shards' and 'single' stages: GPUs per worker process (0: CPU)."""
    nodes: int = Field(1, ge=1)
    """'ranks' stages: nodes of the multi-rank job (more than 1 needs slurm or kubernetes)."""
    ranks_per_node: int = Field(1, ge=1)
    """'ranks' stages: ranks (processes) per node; on GPUs usually gpus_per_node."""
    gpus_per_node: int = Field(0, ge=0)
    """'ranks' stages: GPUs per node (0: CPU ranks over gloo)."""
    cpus_per_task: int = Field(1, ge=1)
    """CPU cores per process: its OMP_NUM_THREADS, Slurm's --cpus-per-task."""
    work_pool: str | None = None
    """prefect launcher: the Prefect work pool whose workers run this stage (a deployment
    `rlpipe-stage/<pool>`, made by `python -m rlpipe.flows.deploy --stage-pool <pool>`); the run
    directory must be on a filesystem those workers share. None: the driver's machine."""
    gpu_ids: tuple[Annotated[int, Field(ge=0)], ...] | None = None
    """processes launcher: the GPUs of this machine the stage uses, numbered as the driver sees
    them (positions in its CUDA_VISIBLE_DEVICES when set), as many as it asks for (workers x
    gpus_per_worker, or gpus_per_node): worker i takes the i-th gpus_per_worker of them, the ranks
    of a 'ranks' stage share them. None: assigned when the run starts (`rlpipe.cluster.gpus`),
    each resident group GPUs of its own while the machine has enough."""

    @property
    def processes(self) -> int:
        """Processes the stage runs as: workers x nodes x ranks_per_node (two of them are 1)."""
        return self.workers * self.nodes * self.ranks_per_node

    @property
    def gpus(self) -> int:
        """GPUs of one process: per worker, or per node shared by its ranks."""
        return self.gpus_per_worker or self.gpus_per_node

    @property
    def gpus_on_a_node(self) -> int:
        """GPUs the stage uses on one node: its workers' (all on this machine), or gpus_per_node."""
        return self.gpus_per_worker * self.workers or self.gpus_per_node

    def worker_gpus(self, worker: int) -> tuple[int, ...]:
        """The GPU ids worker `worker` sees (a 'ranks' stage: worker 0, all its ranks): its block of
        `gpu_ids`, or of 0, 1, ... when none were given."""
        ids = self.gpu_ids if self.gpu_ids is not None else tuple(range(self.gpus_on_a_node))
        return ids[worker * self.gpus:(worker + 1) * self.gpus]


class KubernetesSpec(_Spec):
    """What the kubernetes launcher puts into every Job it renders."""

    image: str = "rlpipe:latest"
    """Container image with rlpipe installed (the driver's image too)."""
    namespace: str = "default"
    """Namespace of the Jobs (the driver's RBAC is granted there)."""
    pvc: str = "rlpipe-runs"
    """PersistentVolumeClaim (ReadWriteMany) holding the run directories, mounted in every pod."""
    runs_mount: str = "/runs"
    """Where the claim is mounted; run directories must lie under it."""
    poll_seconds: float = Field(5.0, gt=0)
    """How often the driver polls a running Job."""


class Launch(_Spec):
    """The `launch` section of a preset: the launcher and the stages it places."""

    launcher: LauncherName = "local"
    """Who runs the placed stages (see LauncherName)."""
    resident: bool = True
    """A placed stage of the RL iterations runs as a worker group started once for the run, which
    takes each iteration's saved config as a work order and keeps its engines warm in memory
    (rollout loads each new policy in place, optimize keeps its DeepSpeed state). False: one
    launch (new processes) per stage call, for GPUs that stages take by turns. Set-up stages
    (sft, reward_model) always launch per call."""
    stall_timeout_s: float = Field(1800.0, gt=0)
    """Resident groups: a call whose workers are alive but write no output for this long is
    stopped and fails as stuck (a hung collective, a deadlock). Progress lines come every few
    seconds while a stage works; allow for the longest silent step, such as loading a large model.
    A group's start (imports, a pod pending, a pool's queue) gets as long, counted from its launch."""
    driver_timeout_s: float = Field(60.0, gt=0)
    """Resident groups on other hosts than the driver's: workers leave when the driver's
    heartbeat (rewritten every driver_timeout_s / 6) stops for this long, and the driver takes a
    member whose heartbeat stops for this long as lost with its node (the run ends, naming the
    host). On the driver's host both sides watch each other's process instead."""
    weight_channel: bool = True
    """Resident groups: optimize sends each new policy to the rollout members over a process group
    made for it (gloo), from memory, and writes its checkpoint in the background as the record,
    instead of the members reading the checkpoint back from disk on the critical path. A member
    that cannot take it from the channel reads the file (one log line says so). False: every
    policy goes through its file."""
    share_gpus: tuple[str, ...] = ()
    """processes launcher: placed stages whose resident groups may hold the same GPUs and take them
    by turns, e.g. [rollout, optimize] on a machine with one GPU. Before every call of a training
    stage ('ranks': optimize) the groups sharing its GPUs make room, as the stages of one process
    do: a vLLM engine sleeps (its weights and KV cache freed) and the next rollout wakes it with
    the new policy. Without it, two resident groups that would hold one GPU are refused when the
    run starts (a vLLM engine keeps gpu_memory_utilization of its GPU for the whole run)."""
    stages: dict[str, StagePlacement] = Field(default_factory=dict)
    """Stage name -> placement. Written in a preset as keys of `launch` itself
    (`launch: {rollout: {workers: 4}}`)."""
    kubernetes: KubernetesSpec = KubernetesSpec()
    """Image, namespace and volume of the kubernetes launcher's Jobs."""

    @model_validator(mode="before")
    @classmethod
    def _stage_keys(cls, data: Any) -> Any:
        """`launch: {rollout: {...}}` -> `stages: {rollout: {...}}`; other keys must be settings
        or stage names."""
        if not isinstance(data, dict):
            return data
        from rlpipe.stages import STAGES

        settings = tuple(cls.model_fields)  # (the fields below: a new knob is a setting at once)
        out = {k: v for k, v in data.items() if k in settings}
        stages = dict(out.get("stages") or {})
        for key, value in data.items():
            if key in settings:
                continue
            if key not in STAGES:
                listed = ", ".join(s for s in settings if s != "stages")
                raise ValueError(f"launch.{key}: neither a setting ({listed}) nor a "
                                 f"stage ({', '.join(STAGES)})")
            stages[key] = value
        if stages:
            out["stages"] = stages
        return out

    @model_validator(mode="after")
    def _fits_the_stage(self) -> Launch:
        from rlpipe.stages import STAGES

        for name, p in self.stages.items():
            if name not in STAGES:
                raise ValueError(f"launch.{name}: not a stage; stages: {', '.join(STAGES)}")
            scaling = STAGES[name].scaling
            wrong = {"shards": ("nodes", "ranks_per_node", "gpus_per_node"),
                     "ranks": ("workers", "gpus_per_worker"),
                     "single": ("workers", "nodes", "ranks_per_node", "gpus_per_node")}[scaling]
            bad = [k for k in wrong if k in p.model_fields_set and getattr(p, k) != StagePlacement.model_fields[k].default]
            if bad:
                hint = {"shards": "it scales by `workers` (N worker processes)",
                        "ranks": "it scales by `nodes` x `ranks_per_node` (one multi-rank job)",
                        "single": "it runs as one process"}[scaling]
                raise ValueError(f"launch.{name}: {', '.join(bad)} do not apply to {name}: {hint}")
            if p.work_pool is not None and self.launcher != "prefect":
                raise ValueError(f"launch.{name}.work_pool: only the prefect launcher routes stages to "
                                 f"work pools (launch.launcher is {self.launcher})")
            if self.launcher in ("processes", "prefect") and p.nodes > 1:
                raise ValueError(f"launch.{name}: nodes={p.nodes}, but the processes launcher runs on "
                                 "this machine; use launcher slurm or kubernetes for several nodes")
            _check_gpu_ids(name, p, self.launcher)
        unplaced = [s for s in self.share_gpus if s not in self.stages]
        if unplaced:
            raise ValueError(f"launch.share_gpus: {', '.join(unplaced)} not placed (placed: "
                             f"{', '.join(self.stages) or 'none'}); it names placed stages that may share GPUs")
        return self

    def make_room_for(self, stage: str) -> list[str]:
        """The placed stages whose groups make room on the GPUs before `stage` runs: for a training
        stage ('ranks'), those of `share_gpus` whose GPU ids (as `rlpipe.cluster.gpus.assign_gpus`
        filled them in) meet its own."""
        from rlpipe.stages import STAGES

        mine = self.stages.get(stage)
        if mine is None or STAGES[stage].scaling != "ranks" or stage not in self.share_gpus:
            return []
        held = set(mine.worker_gpus(0))
        return [s for s in self.share_gpus if s != stage and held & set(self.stages[s].gpu_ids or ())]

    def placement(self, stage: str) -> StagePlacement | None:
        """The placement of `stage`, or None when it runs in the driver's process."""
        if self.launcher == "local":
            return None
        return self.stages.get(stage)


def _check_gpu_ids(stage: str, p: StagePlacement, launcher: str) -> None:
    """A stage's `gpu_ids`: for the processes on this machine, one per GPU it asks for, distinct."""
    if p.gpu_ids is None:
        return
    if launcher in ("slurm", "kubernetes"):
        raise ValueError(f"launch.{stage}.gpu_ids: the {launcher} launcher gives every step or pod GPUs of its "
                         "own; gpu_ids number the GPUs of the driver's machine (launcher processes)")
    if len(p.gpu_ids) != p.gpus_on_a_node or len(set(p.gpu_ids)) != len(p.gpu_ids):
        asked = (f"{p.workers} x gpus_per_worker {p.gpus_per_worker}" if p.gpus_per_worker
                 else f"gpus_per_node {p.gpus_per_node}")
        raise ValueError(f"launch.{stage}.gpu_ids: {list(p.gpu_ids)}, but the stage asks for {p.gpus_on_a_node} "
                         f"GPUs ({asked}): give that many distinct ids")
