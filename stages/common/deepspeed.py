"""DeepSpeed for the training stages (sft, reward_model, optimize): config, engine, saving.

- `ds_config`: the shipped template cluster/deepspeed/zero<stage>.json with its "auto" fields
  filled from the stage's knobs; the one place a DeepSpeed config is made.
- `make_engine`: deepspeed.initialize around a model and a torch optimizer (no FusedAdam build on
  CPU), announcing the one-time C++ build of DeepSpeed's CPU communication op (and clearing the
  build lock a killed build left, which would hang every later one), and taking back
  the zero-gradient step DeepSpeed's ZeRO-0 bf16 wrapper takes (Adam would count it).
- `full_parameters` / `save_pretrained`: the trained weights whole (ZeRO-3 partitions gathered
  one module at a time into a host copy; a collective: every rank must call) and written as a
  Hugging Face checkpoint by rank 0.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import torch

_log = logging.getLogger(__name__)


def import_deepspeed():
    """The deepspeed module, imported after choosing its accelerator (CPU when there is no CUDA)."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with _unimportable("mlflow"):
        import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return deepspeed


@contextlib.contextmanager
def _unimportable(name: str) -> Iterator[None]:
    """Within the block, `import name` raises ImportError (unless it is imported already).

    DeepSpeed's autotuner, imported with deepspeed, imports MLflow where it is installed (rlpipe's
    `loggers` extra) for a feature rlpipe does not use: 2.2 of deepspeed's 2.7 s of import here,
    paid by every process that trains. Importable again after the block (the MLflow sink's own)."""
    if name in sys.modules:
        yield
        return
    sys.modules[name] = None  # type: ignore[assignment]  (the import system's "not importable")
    try:
        yield
    finally:
        if sys.modules.get(name, 0) is None:
            del sys.modules[name]


def number_parameters_from_zero() -> None:
    """ZeRO-3 numbers each parameter it partitions (`ds_id`) from a counter shared by the whole
    process, and its optimizer state saves those numbers, so a train state's bytes would depend on
    how many ZeRO-3 models the process built before: the same run resumed in a new process wrote a
    state of another content hash than uninterrupted (its tensors equal). Called before each build
    of the optimize engines (the engines before them destroyed), the numbers depend on the models alone."""
    deepspeed = import_deepspeed()
    deepspeed.zero.Init.param_id = 0


def use_bf16(dtype: str) -> bool:
    """Train in bf16? `dtype` is a `ComputeDtype`: 'bf16', 'fp32' or 'auto' (bf16 exactly when CUDA
    is present)."""
    from rlpipe.stages.common.model_loading import compute_dtype

    return compute_dtype(dtype) == torch.bfloat16


def deepspeed_template(stage: int) -> dict[str, Any]:
    """The DeepSpeed config template for ZeRO `stage` (0-3), cluster/deepspeed/zero<stage>.json (package
    data of `rlpipe.cluster`, read as data: no import); "auto" fields are filled by `ds_config`."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    text = resources.files("rlpipe.cluster").joinpath(f"deepspeed/zero{stage}.json").read_text()
    return json.loads(text)


def ds_config(zero_stage: int, *, micro_batch_size: int, grad_accum: int, world_size: int,
              grad_clip: float, bf16: bool = False, offload_optimizer: bool = False,
              offload_params: bool = False) -> dict[str, Any]:
    """The zero<stage>.json template with every "auto" field filled, and ZeRO's CPU offload of
    the optimizer state (ZeRO 1-3) and the parameters (ZeRO 3) where asked.

    train_batch_size = micro_batch_size x grad_accum x world_size (DeepSpeed checks this identity).
    """
    cfg = deepspeed_template(zero_stage)
    cfg["train_micro_batch_size_per_gpu"] = micro_batch_size
    cfg["gradient_accumulation_steps"] = grad_accum
    cfg["train_batch_size"] = micro_batch_size * grad_accum * world_size
    cfg["gradient_clipping"] = grad_clip
    cfg["bf16"] = {**cfg["bf16"], "enabled": bf16}
    # page-locked host buffers where there is a GPU to copy to and from (copies without a staging copy)
    offload = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if offload_optimizer:
        cfg["zero_optimization"]["offload_optimizer"] = offload
    if offload_params:
        cfg["zero_optimization"]["offload_param"] = offload
    if offload_optimizer or offload_params:
        # our torch AdamW steps the offloaded state (DeepSpeedCPUAdam would need its C++ op built)
        cfg["zero_force_ds_cpu_optimizer"] = False
    unfilled = [k for k, v in cfg.items() if v == "auto" or (isinstance(v, dict) and "auto" in v.values())]
    if unfilled:
        raise ValueError(f"DeepSpeed template zero{zero_stage}.json has fields nobody fills: {unfilled}")
    return cfg


def make_engine(model: torch.nn.Module, config: dict[str, Any], *,
                optimizer: Callable[[Any], torch.optim.Optimizer],
                lr_lambda: Callable[[int], float] | None = None) -> Any:
    """A DeepSpeed engine around `model`.

    Args:
        optimizer: builds the torch optimizer from the parameters to train (those with
            requires_grad); DeepSpeed calls it after wrapping them (ZeRO-3 partitions first).
        lr_lambda: a LambdaLR factor per optimizer step, which the engine steps; None: constant.
    """
    deepspeed = import_deepspeed()
    params = [p for p in model.parameters() if p.requires_grad]
    scheduler = None
    if lr_lambda is not None:
        def scheduler(opt):
            return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    _announce_op_build()
    fp32_buffers = {name: b.detach().clone() for name, b in model.named_buffers() if b.dtype == torch.float32}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, optimizer=optimizer,
                                      lr_scheduler=scheduler, config=config)
    _keep_fp32_buffers(engine.module, fp32_buffers)
    _undo_state_init_step(engine)
    _no_allreduce_alone(engine)
    return engine


def _keep_fp32_buffers(module: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    """Put back the fp32 buffers DeepSpeed cast with a bf16 engine's module.

    DeepSpeed 0.16 casts the whole module (`module.bfloat16()`), its buffers too (0.19 casts only
    the parameters): rotary frequencies (`inv_freq`) in bf16 keep 8 significant bits, so position
    angles drift with the position, and the trainer's log-probs then differ from those of the same
    bf16 weights as transformers loads them (fp32 frequencies: the reference, the rollout engines).
    """
    for name, buffer in list(module.named_buffers()):
        if name in before and buffer.dtype != torch.float32:
            owner, _, attr = name.rpartition(".")
            module.get_submodule(owner)._buffers[attr] = before[name].to(buffer.device)


def _no_allreduce_alone(engine: Any) -> None:
    """Skip ZeRO 0's gradient all-reduce when the engine is its data-parallel group's only rank.

    There DeepSpeed's all-reduce is the identity, g = (1/1) sum_{r<1} g_r, paid as three full
    copies of every gradient (flattened into a bucket, divided by 1, copied back): 0.3 s per step at
    80M parameters on this CPU, 5% of the step. ZeRO 1-3 reduce in their optimizer (their
    partition bookkeeping needs it), so they keep it."""
    if engine.zero_optimization_stage() == 0 and engine.dp_world_size == 1:
        engine.enable_backward_allreduce = False


def _undo_state_init_step(engine: Any) -> None:
    """Take back the optimizer step DeepSpeed's ZeRO-0 bf16 wrapper (FP16_UnfusedOptimizer) takes
    with zero gradients when it is built, to create the optimizer state.

    That step counts for Adam: the first real update is bias-corrected as step 2,
    lr * (0.1 g / 0.19) / sqrt(0.001 g^2 / 0.001999) = 0.744 lr instead of lr (measured: 0.744),
    and weight decay shrinks the masters once. Torch optimizers create their state lazily at the
    first step, so an empty state and masters re-copied from the module (from which they were
    made) are the state before that step. ZeRO 1-3 take no such step (their first update is lr).
    """
    wrapper = engine.optimizer
    if type(wrapper).__name__ != "FP16_UnfusedOptimizer":
        return
    with torch.no_grad():
        for low, masters in zip(wrapper.fp16_groups, wrapper.fp32_groups, strict=True):
            for lp, hp in zip(low, masters, strict=True):
                hp.copy_(lp.to(hp.dtype))
    wrapper.optimizer.state.clear()


def _announce_op_build() -> None:
    """Say so before DeepSpeed compiles its CPU communication op (first use on a machine: ~1 min
    of silence otherwise). It is built when DeepSpeed's comm backend is first created."""
    try:
        import deepspeed.comm.comm as ds_comm
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import installed_ops
        from deepspeed.ops.op_builder.builder import OpBuilder
        from torch.utils.cpp_extension import _get_build_directory

        if ds_comm.cdb is not None or get_accelerator()._name != "cpu":
            return
        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is None or builder.name in OpBuilder._loaded_ops or installed_ops.get(builder.name, False):
            return
        built = Path(_get_build_directory(builder.name, verbose=False)) / f"{builder.name}.so"
    except (ImportError, AttributeError):  # another DeepSpeed layout: say nothing rather than fail
        return
    _clear_stale_build_lock(built.parent / "lock")
    if not built.exists():
        _log.info(f"building DeepSpeed's CPU communication op {builder.name} (first use on this machine, "
                  f"~1 min; cached in {built.parent})...")


#: A build lock older than this was left by a killed build (the op builds in about a minute).
STALE_BUILD_LOCK_S = 600.0


def _clear_stale_build_lock(lock: Path) -> None:
    """Remove torch's build lock of the op when it is stale. A build killed with SIGKILL (a killed
    stage, on its first DeepSpeed run) leaves the lock file behind, and every later build waits
    on it forever, silently: every DeepSpeed stage on the machine would hang at its start."""
    import time

    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_BUILD_LOCK_S:
        lock.unlink(missing_ok=True)
        _log.warning(f"removed {lock}: a build lock {age / 60:.0f} min old, left by a killed build of the op "
                     "(a build takes about a minute)")


@contextlib.contextmanager
def full_parameters(engine: Any, *, rank: int | None = None,
                    device: torch.device | str = "cpu") -> Iterator[torch.nn.Module | None]:
    """The engine's module with every parameter whole; a collective under ZeRO-3 (every rank calls).

    ZeRO 0-2: the module itself. ZeRO-3: a Hugging Face model's parameters are gathered one module
    at a time (`gathered_by_module`) and copied to `device` (host memory by default) on `rank`
    (None: every rank), where a plain copy of the model is built from them (no DeepSpeed hooks, the
    parameters' dtype; on a GPU, the copy the next stage of this process samples with); ranks
    that keep none get None, and with `rank` given they only send their partitions (a gather to
    `rank`, a parameter at a time). So no accelerator holds more than its partition plus one
    module's parameters: gathered at once, a 70B bf16 model is 140 GB on every GPU. Another module (a LoRA
    wrapper, a scalar head) is gathered whole, as before, and yielded itself on every rank."""
    from transformers import PreTrainedModel

    if engine.zero_optimization_stage() != 3:
        yield engine.module
    elif isinstance(engine.module, PreTrainedModel):
        keep = rank is None or not torch.distributed.is_initialized() or torch.distributed.get_rank() == rank
        writer = rank if rank is not None and torch.distributed.is_initialized() else None
        yield gathered_by_module(engine.module, keep=keep, writer=writer, device=device)
    else:
        deepspeed = import_deepspeed()
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
            yield engine.module


def gathered_by_module(model: Any, *, keep: bool, writer: int | None = None,
                       device: torch.device | str = "cpu") -> Any:
    """A plain copy of ZeRO-3-partitioned `model` (a Hugging Face model) on `device` (the host by
    default), its parameters gathered one module at a time and copied there, each gather released
    before the next;
    with `keep` False this rank only takes part in the gathers and gets None. Tied parameters are
    gathered and copied once.

    `writer`: the one rank that keeps a copy (the others pass `keep` False): each parameter's
    partitions are gathered to it alone (`_gathered_to`), so the other ranks hold nothing beyond
    their partitions; None: every rank that keeps one takes part in DeepSpeed's all-gathers."""
    from rlpipe.stages.common.handoff import rebuilt

    deepspeed = import_deepspeed()
    state: dict[str, torch.Tensor] = {}
    copied: dict[int, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        params = [(f"{prefix}.{n}" if prefix else n, p) for n, p in module.named_parameters(recurse=False)]
        fresh = [p for _, p in params if id(p) not in copied]
        if fresh and writer is not None and all(_gatherable(p) for p in fresh):
            for p in fresh:
                whole = _gathered_to(p, writer, device)  # (a collective: every rank calls it)
                copied[id(p)] = whole if keep else p
        elif fresh:
            with deepspeed.zero.GatheredParameters(fresh, modifier_rank=None):
                for p in fresh:
                    copied[id(p)] = p.detach().to(device=device, copy=True) if keep else p
        if keep:
            state.update({name: copied[id(p)] for name, p in params})
    if not keep:
        return None
    buffers = {name: b.detach().to(device=device, copy=True) for name, b in model.state_dict().items()
               if name not in state}  # (buffers are not partitioned: rotary frequencies, ...)
    # (built on the CPU: the buffers its constructor computes follow the parameters to `device`)
    return rebuilt(model, {**state, **buffers}).to(device)


def gathered_to_owners(model: Any, owners: Mapping[str, int], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of ZeRO-3-partitioned `model` (state-dict name -> the rank that keeps it) this
    rank keeps, on `device`: each parameter's partitions gathered to its owner alone
    (`_gathered_to`), a parameter at a time in module order, once however many names it has (tied
    parameters); buffers, not partitioned, copied by their owner. A collective: every rank calls it
    with the same `owners` (partitioned_handoff.py)."""
    rank = torch.distributed.get_rank()
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    names_of: dict[int, tuple[int, list[str]]] = {}  # id(param) -> (its owner, its names kept)
    kept: dict[str, torch.Tensor] = {}
    for name, owner in owners.items():
        if name in params:
            names_of.setdefault(id(params[name]), (owner, []))[1].append(name)
        elif name not in buffers:
            raise KeyError(f"{name}: neither a parameter nor a buffer of {type(model).__name__}")
        elif owner == rank:
            kept[name] = buffers[name].detach().to(device=device, copy=True)
    deepspeed = import_deepspeed()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) not in names_of:
                continue
            owner, names = names_of.pop(id(p))
            if _gatherable(p):
                whole = _gathered_to(p, owner, device)  # (a collective: every rank calls it)
            else:  # (swapped out to NVMe: DeepSpeed's own gather, to every rank)
                with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                    whole = p.detach().to(device=device, copy=True) if owner == rank else None
            if owner == rank:
                kept.update({name: whole for name in names})
    return kept


def _gatherable(param: torch.nn.Parameter) -> bool:
    """Whether `param`'s ZeRO-3 partition is in memory (not swapped out to NVMe)."""
    part = getattr(param, "ds_tensor", None)
    return part is not None and getattr(part, "final_location", None) is None and hasattr(part, "ds_numel")


def _gathered_to(param: torch.nn.Parameter, writer: int, to: torch.device | str = "cpu") -> torch.Tensor | None:
    """ZeRO-3-partitioned `param` whole on rank `writer`, on device `to` (None on the other ranks).

    ZeRO-3 keeps rank r's part of the flattened parameter, elements [r s, (r + 1) s) with s the
    partition size (the last padded), in `param.ds_tensor`; `torch.distributed.gather` puts each
    rank's part in its place of one flat tensor on the writer, so the other ranks send theirs and
    hold nothing more (an all-gather gives every rank the whole parameter, and gloo a second copy
    of it). A collective: every rank of the parameter's group calls it for the same parameters."""
    if getattr(param, "ds_persist", False) and getattr(getattr(param, "ds_status", None), "name", "") == "AVAILABLE":
        # whole on every rank: a parameter below `stage3_param_persistence_threshold` between
        # forwards. Its data is what the forward reads and DeepSpeed's own gather returns (DeepSpeed
        # 0.16's partition of it was sometimes behind), and nothing need be sent.
        return param.detach().to(device=to, copy=True) if torch.distributed.get_rank() == writer else None
    group = param.ds_process_group
    part = param.ds_tensor
    size, world = part.ds_numel, torch.distributed.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if (
        torch.distributed.get_backend(group) == "nccl") else torch.device("cpu")
    sent = part.to(device)  # (ZeRO-Offload keeps the partitions in host memory; NCCL sends from a GPU)
    if torch.distributed.get_rank() != writer:
        torch.distributed.gather(sent, None, dst=writer, group=group)
        return None
    flat = torch.empty(size * world, dtype=part.dtype, device=device)
    torch.distributed.gather(sent, list(flat.split(size)), dst=writer, group=group)
    return flat[:param.ds_numel].view(param.ds_shape).to(to)


def save_pretrained(engine: Any, tokenizer: Any, out_dir: Path | str, rank: int, *,
                    part: Callable[[Any], Any] | None = None, keep_copy: bool = True,
                    max_shard_size: int | str = "5GB", copy_dtype: torch.dtype = torch.float32) -> Any:
    """Save the full model + tokenizer (rank 0) as a Hugging Face checkpoint; collective under ZeRO-3.

    Args:
        part: picks the Hugging Face model inside the engine's module (e.g. the model a
            head-adding wrapper holds); default: the engine's module itself.
        keep_copy: return a copy of the saved model (for the in-process cache), in `copy_dtype`.
        max_shard_size: above this size the weights go into several files plus an index.

    Returns, on rank 0 with `keep_copy`, a plain copy of the saved model in eval mode (no
    DeepSpeed hooks), equal to what loading `out_dir` gives; else None.
    """
    from rlpipe.stages.common.handoff import model_copy
    from rlpipe.stages.common.tiny import save_pretrained as save

    copy = None
    with full_parameters(engine, rank=0) as whole:
        if rank == 0:
            module = whole if part is None else part(whole)
            save(module, tokenizer, out_dir, max_shard_size=max_shard_size)
            if not keep_copy:
                return None
            copy = model_copy(module, copy_dtype)
    return copy
