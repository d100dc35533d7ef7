"""Which GPUs of the driver's machine each placed stage's processes use, decided before anything
starts.

The `processes` launcher (and `prefect` for stages without a work pool) starts placed stages on
the driver's machine, each process seeing only its GPUs (CUDA_VISIBLE_DEVICES). A resident group
holds its GPUs for the whole run: a vLLM engine keeps `gpu_memory_utilization` of its GPU, a
DeepSpeed job its weights and optimizer state. So two resident groups on one GPU would either
run out of memory in the middle of a run or, worse, fit by luck on one machine and not another.
`assign_gpus` therefore gives every resident group GPUs of its own while the machine has enough,
and refuses a run where two would share one, naming both stages and the GPU, unless the preset
lets them take turns (`launch.share_gpus`; the launcher then has them make room before each
training call, `Launch.make_room_for`). Per-call launches (set-up stages, `launch.resident: false`)
run one at a time: they take the first GPUs. Slurm and Kubernetes give each step or pod GPUs of
its own, so nothing is assigned there.

    >>> launch = Launch.model_validate({"launcher": "processes", "rollout": {"gpus_per_worker": 1},
    ...                                 "optimize": {"gpus_per_node": 1}})
    >>> placed = assign_gpus(launch, {"rollout", "optimize"}, visible=["0", "1"])
    >>> placed.stages["rollout"].gpu_ids, placed.stages["optimize"].gpu_ids
    ((0,), (1,))
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence

from rlpipe.cluster.placement import Launch, StagePlacement
from rlpipe.schemas.config_files import ConfigError


class GpuConflict(ConfigError):
    """Two resident groups would hold the same GPU, or a stage asks for GPUs the machine lacks."""


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs the driver sees, as CUDA names them: its CUDA_VISIBLE_DEVICES when set (a stage's
    `gpu_ids` are positions in that list), else every device torch counts (0, 1, ...)."""
    env = os.environ if env is None else env
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def cuda_visible_devices(ids: Sequence[int], driver: str | None) -> str:
    """CUDA_VISIBLE_DEVICES of a process given GPUs `ids`: the driver's own devices at those
    positions when it lists some (`driver`: its CUDA_VISIBLE_DEVICES), else the ids themselves."""
    names = [d.strip() for d in (driver or "").split(",") if d.strip()]
    return ",".join(names[i] if names else str(i) for i in ids)


def on_this_machine(launch: Launch, stage: str) -> bool:
    """Whether the launcher starts `stage`'s processes on the driver's machine."""
    p = launch.stages[stage]
    return launch.launcher == "processes" or launch.launcher == "prefect" and p.work_pool is None


def assign_gpus(launch: Launch, resident: Collection[str], *, visible: Sequence[str] | None = None,
                overlapped: bool = False) -> Launch:
    """`launch` with the `gpu_ids` of every placed stage that runs on this machine filled in.

    A stage keeps the ids its preset gives. A resident group (a stage the iterations call, in
    `resident`, with `launch.resident`) gets the lowest ids no other resident group holds (the
    first ones again once every GPU is held, which the check below then refuses unless shared);
    a per-call launch the first ids.

    Args:
        visible: the GPUs of the machine (default: `visible_gpus()`, only asked when a stage here
            wants GPUs).
        overlapped: the iterations overlap (`async.staleness`): optimize trains while the next
            rollout samples, so the two cannot take one GPU by turns.

    Raises:
        GpuConflict: a stage asks for more GPUs than the machine has, names an id it lacks, or
            two resident groups would hold one GPU without `launch.share_gpus` naming both.
    """
    here = [s for s, p in launch.stages.items() if on_this_machine(launch, s) and p.gpus_on_a_node]
    if launch.launcher == "local" or not here:
        return launch
    gpus = list(visible_gpus() if visible is None else visible)
    resident = [s for s in here if launch.resident and s in resident]
    for stage in here:
        _check_fits(stage, launch.stages[stage], len(gpus))
    ids = {s: launch.stages[s].gpu_ids for s in here if launch.stages[s].gpu_ids is not None}
    for stage in resident:
        if stage not in ids:
            held = [ids[s] for s in resident if s in ids]
            ids[stage] = _lowest_free(launch.stages[stage].gpus_on_a_node, len(gpus), held)
    for stage in here:
        ids.setdefault(stage, tuple(range(launch.stages[stage].gpus_on_a_node)))
    placed = launch.model_copy(update={"stages": {
        s: p.model_copy(update={"gpu_ids": ids[s]}) if s in ids else p for s, p in launch.stages.items()}})
    _refuse_shared(placed, resident, len(gpus), overlapped)
    return placed


def _check_fits(stage: str, p: StagePlacement, available: int) -> None:
    if p.gpus_on_a_node > available:
        raise GpuConflict(f"launch.{stage} asks for {_gpus(p.gpus_on_a_node)}, but this machine has {available} "
                          f"(CUDA_VISIBLE_DEVICES, else torch.cuda.device_count()); ask for fewer, or run on "
                          "a machine with more (launcher slurm or kubernetes for several)")
    beyond = [i for i in p.gpu_ids or () if i >= available]
    if beyond:
        raise GpuConflict(f"launch.{stage}.gpu_ids: {beyond[0]} is not a GPU of this machine, which has "
                          f"{available} (ids 0 to {available - 1}, positions in CUDA_VISIBLE_DEVICES when set)")


def _lowest_free(count: int, available: int, held: list[tuple[int, ...]]) -> tuple[int, ...]:
    """`count` ids, the lowest no group in `held` holds first, then the least-held ones."""
    use = {i: 0 for i in range(available)}
    for ids in held:
        for i in ids:
            use[i] += 1
    return tuple(sorted(sorted(use, key=lambda i: (use[i], i))[:count]))


def _refuse_shared(launch: Launch, resident: list[str], available: int, overlapped: bool) -> None:
    """Raise GpuConflict for the first two resident groups that would hold one GPU unshared."""
    for i, a in enumerate(resident):
        for b in resident[i + 1:]:
            common = sorted(set(launch.stages[a].gpu_ids or ()) & set(launch.stages[b].gpu_ids or ()))
            if not common:
                continue
            which = f"GPU{'s' if len(common) > 1 else ''} {', '.join(map(str, common))}"
            shared = a in launch.share_gpus and b in launch.share_gpus
            if shared and not (overlapped and "optimize" in (a, b)):
                continue
            if shared:
                raise GpuConflict(f"launch.share_gpus: {a} and {b} cannot take {which} by turns: async.staleness "
                                  "runs the next rollout while optimize trains; give them GPUs of their own "
                                  f"(launch.<stage>.gpu_ids) or set async.staleness: 0")
            raise GpuConflict(
                f"launch: the resident groups of {a} and {b} would both hold {which} for the whole run (this "
                f"machine has {_gpus(available)}); give each GPUs of its own "
                f"(launch.{a}.gpu_ids, launch.{b}.gpu_ids), let them take turns with launch.share_gpus: "
                f"[{a}, {b}] (a vLLM engine then sleeps while optimize trains), or set launch.resident: false "
                "(new processes per call)")


def _gpus(n: int) -> str:
    return f"{n} GPU{'' if n == 1 else 's'}"
