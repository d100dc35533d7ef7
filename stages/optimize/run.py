"""The optimisation stage: K epochs of PPO-clip-family updates with DeepSpeed, on saved artifacts.

Reads rollouts + advantages (+ reference log-probs), recomputes the old log-probs with the training
model (by default), runs seeded shuffled minibatches with gradient accumulation on W ranks, and
writes the new policy (and critic) checkpoints and a `metrics` artifact. Rank 0 writes the metrics,
the critic, then the policy (the next rollout's input, so first); every rank then writes the train
state, in a background thread by default (stages/common/background.py): the next stages run while
it is written, the next optimize waits for it, and the stage's cache hit needs all its outputs.

Training state: AdamW moments, fp32 masters, the LR schedule's position and the global step persist
between iterations in a `train_state` artifact (state.py), written every `state_every` iterations:
the input state, the optimize runs since it (`replay`, rerun from their saved artifacts), the input
artifacts and the config determine a rerun completely, so a resumed run reproduces the same
parameters. In one process the engines stay warm after every run, and the next run that continues
from exactly the state they hold takes them instead (replay.py). The optimize steps themselves
(the batch cut into steps, the epochs on the engines) are training.py's, which replay also reruns.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rlpipe.schemas import (
    METRICS,
    InputRef,
    Manifest,
    read_manifest,
    write_table_artifact,
)
from rlpipe.schemas.pending import register_elsewhere
from rlpipe.schemas.staging import staged_directory
from rlpipe.schemas.writer import commit_directory
from rlpipe.stages.common.background import background_allowed, in_background, wait_for_background
from rlpipe.stages.common.channel_end import CHANNEL
from rlpipe.stages.common.model_loading import compute_dtype
from rlpipe.stages.common.models import keeps_saved_checkpoints, remember
from rlpipe.stages.common.stage_io import StageStart, opens
from rlpipe.stages.optimize.config import OptimizeConfig
from rlpipe.stages.optimize.data import Batch
from rlpipe.stages.optimize.replay import (
    clear_warm as clear_warm,  # (re-exported: tests drop warm engines)
)
from rlpipe.stages.optimize.replay import (
    engines_for,
    keep_warm,
    rekey_warm,
    saved_state_id,
    unsaved_state_id,
)
from rlpipe.stages.optimize.training import Engines, prepare, train

STAGE = "optimize"


def run(config: OptimizeConfig, *, force: bool = False) -> Manifest:
    """Run the stage; returns the new policy checkpoint's manifest (on every rank). A train state
    the previous run in this process is still writing (maybe this run's input), or a checkpoint it
    writes from the engine's own tensors, is waited for first; the last policy written from its own
    snapshot goes on being written (on a GPU at 1B, 2 GB written while this run trains)."""
    wait_for_background(detached_in_flight=1)
    return _run(config, force=force)


@opens(STAGE)
def _run(config: OptimizeConfig, start: StageStart) -> Manifest:
    from rlpipe.stages.common import deepspeed as ds
    from rlpipe.stages.common.distributed import init_distributed
    from rlpipe.stages.optimize import engine as E

    d = init_distributed()
    work = prepare(config, d)
    timing: dict[str, float] = {}
    # the state after the replayed runs (warm, or train_state + the `replay` checkpoints' steps)
    engines, tokenizer = engines_for(E, config, work.dscfg, start.inputs, d, timing)
    timing["setup_s"] = time.time() - start.started
    rows = train(E, config, work, engines, tokenizer.pad_token_id, d.world_size, timing)
    return _save(ds, config, start, work.batch, rows, engines, tokenizer, d.rank, timing)


def _save(ds: Any, config: OptimizeConfig, start: StageStart, batch: Batch, rows: list[tuple[int, str, float]],
          engines: Engines, tokenizer: Any, rank: int, timing: dict[str, float]) -> Manifest:
    """Rank 0 writes metrics, the critic, then the policy (the next rollout's input, so first);
    then every rank the train state, in the background unless `background_state_save` is off. The
    engines stay warm for the next run, under the id of the state they hold (replay.py)."""
    key, inputs, started = start.key, start.inputs, start.started
    resolved = config.resolved()
    # Outputs a killed run already wrote with this cache key (its train state was cut short)
    # stay as they are: the same work gives the same content, and nothing complete is rewritten.
    if rank == 0 and "metrics_output" not in start.outputs_written:
        table = {"run": [config.run] * len(rows), "iteration": [batch.iteration] * len(rows),
                 "stage": [STAGE] * len(rows), "step": [r[0] for r in rows], "name": [r[1] for r in rows],
                 "value": [r[2] for r in rows]}
        write_table_artifact(config.metrics_output, METRICS, table, stage=STAGE, config=resolved,
                             inputs=inputs, cache_key=key)
    summary = {name: value for step, name, value in rows if step == max(r[0] for r in rows) or step == 0}
    handed = None
    for engine, field, kind in ((engines.critic, "critic_output", "critic"), (engines.policy, "output", "causal")):
        out = getattr(config, field)
        if engine is None or field in start.outputs_written:
            continue
        out = Path(out)
        lora = kind == "causal" and config.lora is not None
        extra = {"metrics": summary, "kind": kind, "timing": timing}
        sends = kind == "causal" and not lora and CHANNEL.sends()
        if kind == "causal" and not lora and (_hands_over() or sends):
            # the next rollout takes the policy from memory (this process's, or the resident
            # rollout members' over the weight channel); its files are written in the background
            # (handoff.py, weight_channel.py)
            handed = _hand_over_policy(ds, config, engine, tokenizer, out, rank, sends, manifest_fields=dict(
                stage=STAGE, config=resolved, inputs=inputs, cache_key=key,
                extra={**extra, "written": "background"}, wall_time_s=time.time() - started))
            continue
        with staged_directory(out, write=rank == 0) as staging:  # the old checkpoint stays until complete
            copy = ds.save_pretrained(engine, tokenizer, staging, rank, part=_merged if lora else None,
                                      keep_copy=keeps_saved_checkpoints(), max_shard_size=config.max_shard_size,
                                      copy_dtype=compute_dtype(config.dtype))
            if rank == 0:
                if lora:
                    extra["lora"] = _save_adapter(config, engine.module, staging, inputs)
                commit_directory(staging, stage=STAGE, config=resolved, inputs=inputs, cache_key=key,
                                 extra=extra, wall_time_s=time.time() - started)
        if copy is not None:
            remember(out, kind, copy, tokenizer)  # the next rollout / values step reads it from memory
    torch.distributed.barrier()
    # (a policy handed over is known by its decided manifest: its write may still run, or have
    # failed, which the next wait for the background raises)
    policy = handed if handed is not None else read_manifest(config.output)
    keep_warm(engines, unsaved_state_id(policy))
    if "train_state_output" in start.outputs_written:
        rekey_warm(unsaved_state_id(policy), saved_state_id(read_manifest(config.train_state_output).content_hash))
    elif config.train_state_output is not None:
        in_thread = config.background_state_save and background_allowed()
        save = partial(_save_state, config, start, engines, rank, unsaved_state_id(policy), in_thread)
        if in_thread:
            in_background(save, str(config.train_state_output))  # while the next rollout runs
        else:
            save()
    return policy


def _hand_over_policy(ds: Any, config: OptimizeConfig, engine: Any, tokenizer: Any, out: Path, rank: int,
                      sends: bool, manifest_fields: dict[str, Any]) -> Manifest:
    """Hand the new policy over in memory (this process's next rollout, or the weight channel's
    members), its checkpoint written in the background; returns its manifest, on every rank.

    ZeRO-3 on several ranks, sending: each rank gathers, sends and writes its own files
    (partitioned_handoff.py), by the files' layout learnt from the first save, which gathers the
    model to rank 0 as a single rank's does. ZeRO-3 in this process: gathered straight onto the
    device the next rollout samples on, and handed over as it is, not gathered into host memory
    and moved back by the rollout (at 1B on an H200, ZeRO-3's optimize spent 0.75 s of each
    iteration outside its steps; docs/cluster.md#gpu)."""
    from transformers import PreTrainedModel

    from rlpipe.stages.common import handoff, partitioned_handoff

    send = CHANNEL.send if sends else None
    partitioned = (sends and engine.zero_optimization_stage() == 3 and torch.distributed.get_world_size() > 1
                   and isinstance(engine.module, PreTrainedModel))
    plan = partitioned_handoff.plan_for(engine.module, tokenizer, config.max_shard_size) if partitioned else None
    if plan is not None:
        return partitioned_handoff.hand_over(engine.module, plan, out, manifest_fields=manifest_fields, send=send,
                                             write_weights=_writes_policy_weights(config))
    onto = engine.device if _hands_over() and engine.zero_optimization_stage() == 3 else "cpu"
    with ds.full_parameters(engine, rank=0, device=onto) as whole:
        decided = copy = None
        if rank == 0:
            decided, copy = handoff.hand_over(
                whole, tokenizer, out, max_shard_size=config.max_shard_size, copy=_hands_over(),
                disposable=whole is not engine.module,
                copy_dtype=compute_dtype(config.dtype),  # (the rollout's, where both follow model.dtype)
                # the engine's own tensors (the next run waits for the write), or the copy
                # ZeRO-3 gathered module by module (nobody else holds it)
                stable=whole is not engine.module or engine.zero_optimization_stage() < 3,
                send=send, write_weights=_writes_policy_weights(config), manifest_fields=manifest_fields)
    if partitioned:  # (the files' layout, for every later save)
        partitioned_handoff.learn_plan(engine.module, tokenizer, config.max_shard_size,
                                       handoff.last_form() if rank == 0 else None)
    if copy is not None:
        remember(out, "causal", copy, tokenizer)
    return _known_on_every_rank(out, decided, rank)


def _known_on_every_rank(out: Path, decided: Manifest | None, rank: int) -> Manifest:
    """Rank 0 decided the manifest of checkpoint `out`, written in its background: the other ranks
    know it too (pending, its files waited for on disk), as `read_manifest` follows. Returns it."""
    if torch.distributed.get_world_size() == 1:
        assert decided is not None
        return decided
    shared = [decided.model_dump_json() if decided is not None else None]
    torch.distributed.broadcast_object_list(shared, src=0)
    manifest = Manifest.model_validate_json(shared[0])
    if rank != 0:
        register_elsewhere(out, manifest)
    return manifest


def _writes_policy_weights(config: OptimizeConfig) -> bool:
    """Whether the policy handed over in memory is also written whole (`policy_weights`): always,
    but between train-state saves with 'with_train_state'."""
    return config.policy_weights == "every_iteration" or config.train_state_output is not None


def _hands_over() -> bool:
    """Whether the new policy goes to the next stage in memory, written in the background: in a
    process that keeps what it saves for the next stage and waits for background saves (the local
    runner), on one rank."""
    return keeps_saved_checkpoints() and background_allowed() and torch.distributed.get_world_size() == 1


def _save_state(config: OptimizeConfig, start: StageStart, engines: Engines, rank: int, warm_id: str,
                in_thread: bool) -> None:
    """Write the train state (collective: every rank; DeepSpeed's checkpoint, each rank its own
    files), staged like the checkpoints: the old state stays whole until the new one and its
    manifest are complete. Then the warm engines are known by the saved state's id."""
    from rlpipe.stages.optimize.state import KIND, save_engines

    mark = time.perf_counter()
    out = Path(config.train_state_output)
    with staged_directory(out, write=rank == 0, shared=True) as staging:
        record = save_engines(engines.roles(), staging, rank, engines.rng)
        if rank == 0:
            commit_directory(staging, stage=STAGE, config=config.resolved(), inputs=start.inputs, cache_key=start.key,
                             extra={"kind": KIND, **record, "save_s": round(time.perf_counter() - mark, 3),
                                    **({"written": "background"} if in_thread else {})},
                             wall_time_s=time.time() - start.started)
    torch.distributed.barrier()
    rekey_warm(warm_id, saved_state_id(read_manifest(out).content_hash))


def _merged(module: Any) -> Any:
    from rlpipe.stages.optimize.lora import merged_model

    return merged_model(module)


def _save_adapter(config: OptimizeConfig, module: Any, staging: Path, inputs: dict[str, InputRef]) -> dict[str, Any]:
    """A LoRA policy checkpoint's adapter (staging/adapter/) and its manifest record."""
    from rlpipe.stages.optimize import lora

    lora.save_adapter(module, staging / lora.ADAPTER_DIR)
    trainable, total = lora.parameter_counts(module)
    continued = "train_state" in inputs or bool(config.replay)  # the adapters come from earlier runs
    return {"adapter": lora.ADAPTER_DIR, **config.lora.model_dump(), "trainable_parameters": trainable,
            "total_parameters": total, "base": lora.base_record(config.policy, continued)}
