"""The optimize stage's training state between iterations: a `train_state` artifact.

What persists (everything a continued run needs to take the next optimizer step as if it had
never stopped): the fp32 master weights, AdamW's moments and step counts, the LR scheduler's
state, the global optimizer step, and the stage's torch RNG state. It is DeepSpeed's own
checkpoint (`engine.save_checkpoint` / `engine.load_checkpoint`), so DeepSpeed's tooling works on
it (`zero_to_fp32.py`, `ds_to_universal`):

    train_state/
      policy/latest, policy/state/mp_rank_00_model_states.pt [, zero_pp_rank_R_mp_rank_00_optim_states.pt]
      critic/...                    the same for the critic (PPO), when there is one
      topology.json                 zero_stage, world_size, bf16, global_steps of the saving run
      _manifest.json                content hash over every file above (written last)

Loading under another topology (ZeRO stage or world size): a state saved under ZeRO 1/2 is
converted with DeepSpeed's `ds_to_universal` (per-parameter fp32 master, exp_avg, exp_avg_sq,
step) and loaded by DeepSpeed's universal loader into a ZeRO 1/2 engine, or, for a ZeRO 0 engine
(which DeepSpeed's universal loader does not serve), copied parameter by parameter into its
torch AdamW (and the bf16 path's fp32 masters). A ZeRO 0 state loads under any world size as it
is (one unpartitioned optimizer state). Other changes (ZeRO 3, ZeRO 0 -> ZeRO 1/2, fp32 <-> bf16)
stop with an error that says so.
"""

from __future__ import annotations

import json
import tempfile
import types
from pathlib import Path
from typing import Any

import torch

#: DeepSpeed checkpoint tag (one state per artifact).
TAG = "state"
TOPOLOGY = "topology.json"
#: The manifest's extra.kind of a train_state artifact (what `Input("train_state")` checks).
KIND = "train_state"


def topology(engine: Any) -> dict[str, Any]:
    """How the engine's state is laid out: ZeRO stage, data-parallel world size, bf16."""
    return {"zero_stage": int(engine.zero_optimization_stage()), "world_size": int(engine.dp_world_size),
            "bf16": bool(engine.bfloat16_enabled())}


def save_engines(engines: dict[str, Any], out: Path, rank: int, rng_state: torch.Tensor) -> dict[str, Any]:
    """Write each engine's DeepSpeed checkpoint under out/<role>/ (collective: every rank calls)
    into `out`, an empty staging directory rank 0 has created (`staged_directory(..., shared=True)`).

    Returns the topology record (also written to out/topology.json by rank 0)."""
    import torch.distributed as dist

    dist.barrier()  # out exists on every rank before any writes into it
    record: dict[str, Any] = {}
    for role, engine in engines.items():
        client = {"torch_rng_state": rng_state, MASTER_NAMES: _master_names(engine)}
        engine.save_checkpoint(str(out / role), tag=TAG, client_state=client)
        record = {**topology(engine), "global_steps": int(engine.global_steps)}
    if rank == 0:
        (out / TOPOLOGY).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    dist.barrier()
    return record


#: client-state key: the parameter names of the fp32 masters, in the optimizer's group order,
#: where DeepSpeed records none (ZeRO 0 in bf16: `param_shapes` is saved only under ZeRO).
MASTER_NAMES = "rlpipe_master_names"


def _master_names(engine: Any) -> list[str] | None:
    """The names of the unfused bf16 optimizer's fp32 masters (`fp32_groups`), group by group."""
    groups = getattr(engine.optimizer, "fp16_groups", None)
    if engine.zero_optimization_stage() > 0 or not engine.bfloat16_enabled() or groups is None:
        return None
    name_of = {id(p): n for n, p in engine.module.named_parameters()}
    return [name_of[id(p)] for group in groups for p in group]


def load_engines(engines: dict[str, Any], state: Path) -> torch.Tensor | None:
    """Continue every engine from the train_state artifact `state`; returns the saved RNG state."""
    saved = json.loads((state / TOPOLOGY).read_text())
    rng = None
    for role, engine in engines.items():
        folder = state / role
        if not folder.is_dir():
            raise ValueError(f"{state}: holds no {role} state (saved without a {role}); start the {role} fresh "
                             "by leaving train_state unset")
        now = topology(engine)
        if _same_layout(saved, now):
            path, client = engine.load_checkpoint(str(folder), tag=TAG, load_module_strict=True)
            if path is None:
                raise ValueError(f"{folder}: DeepSpeed found no checkpoint tagged {TAG!r}")
        else:
            client = _load_converted(engine, folder, saved, now)
        rng = client.get("torch_rng_state", rng)
    return rng


def _same_layout(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """DeepSpeed loads its own checkpoint as it is: same ZeRO stage and, when partitioned, the same
    world size (ZeRO 0 keeps one whole optimizer state, valid on any world size)."""
    if saved["bf16"] != now["bf16"]:
        raise ValueError(f"train_state saved with bf16={saved['bf16']} cannot continue with bf16={now['bf16']} "
                         "(set optimize.dtype as the run that saved it)")
    return saved["zero_stage"] == now["zero_stage"] and (now["zero_stage"] == 0 or saved["world_size"] == now["world_size"])


def _load_converted(engine: Any, folder: Path, saved: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """Another ZeRO stage or world size: through DeepSpeed's universal checkpoint."""
    what = (f"a train_state saved under ZeRO {saved['zero_stage']} on {saved['world_size']} ranks cannot continue "
            f"under ZeRO {now['zero_stage']} on {now['world_size']} ranks")
    if saved["zero_stage"] not in (1, 2) or now["zero_stage"] == 3:
        raise ValueError(f"{folder}: {what}; supported: the same layout, ZeRO 0 on any world size, and "
                         "ZeRO 1/2 -> ZeRO 0/1/2 on any world size")
    with tempfile.TemporaryDirectory(prefix="rlpipe-universal-") as tmp:
        universal = Path(tmp) / TAG
        to_universal(folder / TAG, universal)
        client = torch.load(folder / TAG / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        if now["zero_stage"] == 0:
            _universal_into_zero0(engine, universal)
        else:
            engine._config.load_universal_checkpoint = True  # DeepSpeed's own universal loader
            try:
                engine.load_checkpoint(tmp, tag=TAG, load_module_strict=True)
            finally:
                engine._config.load_universal_checkpoint = False
    return client


def to_universal(checkpoint: Path, out: Path) -> None:
    """DeepSpeed's `ds_to_universal` on one tagged ZeRO 1/2 checkpoint folder (in this process)."""
    import contextlib
    import io

    from rlpipe.stages.common.deepspeed import import_deepspeed

    import_deepspeed()
    from deepspeed.checkpoint import ds_to_universal

    args = types.SimpleNamespace(input_folder=str(checkpoint), output_folder=str(out), num_extract_workers=1,
                                 num_merge_workers=1, keep_temp_folder=False, strict=True,
                                 inject_missing_state=True)  # our engines record no Megatron-style extra info
    with contextlib.redirect_stdout(io.StringIO()):
        ds_to_universal.main(args)


def _universal_into_zero0(engine: Any, universal: Path) -> None:
    """Copy a universal checkpoint (per parameter: fp32 master, exp_avg, exp_avg_sq, step) into a
    ZeRO 0 engine: its torch AdamW state, its fp32 masters (bf16: DeepSpeed's unfused optimizer's
    fp32 groups) and module weights, the LR scheduler and the global step."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    opt = engine.optimizer
    if hasattr(opt, "fp32_groups"):  # bf16 at ZeRO 0: fp32 masters beside the bf16 module
        pairs = [(m, f) for mg, fg in zip(opt.fp16_groups, opt.fp32_groups, strict=True) for m, f in zip(mg, fg, strict=True)]
        inner = opt.optimizer
    else:
        pairs = [(p, p) for group in opt.param_groups for p in group["params"]]
        inner = opt
    for module_param, master in pairs:
        folder = universal / "zero" / names[id(module_param)]

        def read(name: str, folder: Path = folder) -> torch.Tensor:
            x = torch.load(folder / f"{name}.pt", map_location="cpu", weights_only=False)
            return x["param"] if isinstance(x, dict) else x

        fp32 = read("fp32").reshape(master.shape)
        with torch.no_grad():
            master.copy_(fp32)
            module_param.copy_(fp32.to(module_param.dtype))
        inner.state[master] = {"step": read("step").reshape(()).float().clone(),
                               "exp_avg": read("exp_avg").reshape(master.shape).clone(),
                               "exp_avg_sq": read("exp_avg_sq").reshape(master.shape).clone()}
    states = torch.load(universal / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    if engine.lr_scheduler is not None and states.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(states["lr_scheduler"])
    engine.global_steps = int(states["global_steps"])
    engine.global_samples = int(states.get("global_samples", 0))


def master_weights(state: Path, role: str = "policy") -> dict[str, torch.Tensor]:
    """The fp32 master weights of a train_state, read with DeepSpeed's tooling: `zero_to_fp32`
    for ZeRO 1-3 states; at ZeRO 0, the optimizer's own masters from the model-states file
    (bf16: the unfused optimizer's `fp32_groups`; fp32: the module weights are the masters)."""
    folder = state / role
    record = json.loads((state / TOPOLOGY).read_text())
    if record["zero_stage"] > 0:
        from rlpipe.stages.common.deepspeed import import_deepspeed

        import_deepspeed()
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=TAG))
    states = torch.load(folder / TAG / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    if not record["bf16"]:
        return dict(states["module"])
    names = states[MASTER_NAMES]  # DeepSpeed saves no param_shapes without ZeRO (save_engines)
    masters = [t for group in states["optimizer"]["fp32_groups"] for t in group]
    return dict(zip(names, masters, strict=True))
