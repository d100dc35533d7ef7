"""The engines an optimize run starts from: warm ones of this process, or ones continued from the
last saved train state with the optimize steps since replayed (`state_every` > 1).

The state an engine pair holds (weights, fp32 masters, AdamW moments, LR schedule, RNG) is named
by a state id:

    saved:<content hash>                  a train_state artifact
    after:<cache key>:<content hash>      what the optimize run with that cache key left, whose
                                          policy checkpoint has that content hash (no state saved)

A run continues from the state after the last of its `replay` checkpoints, or from `train_state`
when it replays none. In one process the engines stay warm after every run, under the id of the
state they hold, and the next run whose state that is takes them. Otherwise the run loads
`train_state` (or starts fresh) and reruns the optimize steps of the `replay` checkpoints in order
(from the warm engines instead when they hold the state after some of them), each on the inputs
and with the knobs its manifest records, writing nothing; then the replayed policy must equal the
last checkpoint bit for bit: the same deterministic kernels on the same inputs give the same bits,
so any difference is a changed input or nondeterminism (another world size, ZeRO stage or
device sums in another order), and the run stops rather than continue from another state.

Process-wide state: one object per process, `WARM` (a `WarmEngines`), owned by this module: the
engines the last optimize run left, under the id of the state they hold. `WARM.reset()` (or
`clear_warm()`) destroys them, as a fresh process has none, so the next run builds its engines and
loads the state from disk; tests reset it with every other process-wide object through
`rlpipe.stages.common.process_state.reset_process_state()` (registered when this module is imported).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from rlpipe.schemas import InputRef, Manifest, read_manifest
from rlpipe.schemas.config import split_list_item
from rlpipe.schemas.errors import UserError
from rlpipe.stages.common.process_state import register
from rlpipe.stages.optimize.config import OptimizeConfig
from rlpipe.stages.optimize.training import Engines, prepare, train

_log = logging.getLogger(__name__)


class WarmEngines:
    """The engines the last optimize run in this process left (see the module doc)."""

    def __init__(self) -> None:
        self.by_state: dict[str, Engines] = {}
        """State id -> the engines holding that state (the last run's: one entry at most)."""

    def keep(self, engines: Engines, state_id: str) -> None:
        self.reset()
        self.by_state[state_id] = engines

    def rekey(self, old: str, new: str) -> None:
        if old in self.by_state:
            self.by_state[new] = self.by_state.pop(old)

    def reset(self) -> None:
        """Destroy the warm engines: a fresh process has none."""
        for engines in self.by_state.values():
            engines.destroy()
        self.by_state.clear()


#: This process's warm engines (see the module doc).
WARM = register(WarmEngines())


def saved_state_id(content_hash: str) -> str:
    return f"saved:{content_hash}"


def unsaved_state_id(policy: Manifest) -> str:
    """The state the optimize run that wrote the policy checkpoint `policy` left."""
    return f"after:{policy.cache_key}:{policy.content_hash}"


def keep_warm(engines: Engines, state_id: str) -> None:
    """Keep `engines`, holding the state `state_id`, for the next run (in place of any others)."""
    WARM.keep(engines, state_id)


def rekey_warm(old: str, new: str) -> None:
    """The warm engines held under `old` hold the state `new` names (its save completed)."""
    WARM.rekey(old, new)


def clear_warm() -> None:
    """Drop the warm engines (tests; a process that wants its memory back): `WARM.reset()`."""
    WARM.reset()


def engine_knobs(config: OptimizeConfig, dscfg: dict[str, Any]) -> str:
    """Everything an engine is built from besides the state it holds: equal knobs and an equal
    state mean the warm engine is the one a cold build + load_checkpoint would give."""
    keys = ("lr", "critic_lr", "weight_decay", "betas", "lr_schedule", "warmup_steps", "total_steps",
            "min_lr_ratio", "zero_stage", "dtype", "gradient_checkpointing", "seed", "lora")
    knobs = {k: getattr(config, k) for k in keys}
    return json.dumps({**knobs, "critic": config.critic is not None, "deepspeed": dscfg}, sort_keys=True, default=str)


def engines_for(E: Any, config: OptimizeConfig, dscfg: dict[str, Any], inputs: dict[str, InputRef], d: Any,
                timing: dict[str, float]) -> tuple[Engines, Any]:
    """(engines holding the state this run continues from, built with its knobs; the tokenizer)."""
    from rlpipe.stages.common.models import shared_tokenizer

    manifests = [_chained(config, inputs, i) for i in range(len(config.replay))]
    state = Path(config.train_state) if config.train_state is not None else None
    ids = [saved_state_id(inputs["train_state"].content_hash) if state is not None else None]
    ids += [unsaved_state_id(manifest) for manifest in manifests]
    held = next((i for i in reversed(range(len(ids))) if ids[i] in WARM.by_state), None)
    engines = WARM.by_state.pop(ids[held]) if held is not None else None
    WARM.reset()  # engines holding any other state are of no further use
    beside = Path(config.output)  # where a scratch transfer between engines goes
    tokenizer = shared_tokenizer(config.policy)
    if manifests[held or 0:]:
        mark = time.perf_counter()
        for i in range(held or 0, len(manifests)):
            step = _replayed_config(manifests[i], Path(config.replay[i]), i)
            work = prepare(step, d)
            engines = _fit(E, engines, step, work.dscfg, state, d.rank, beside)
            train(E, step, work, engines, tokenizer.pad_token_id, d.world_size, {})
        check_replayed(engines, config.replay[-1], manifests[-1], tokenizer)
        timing["replay_s"] = time.perf_counter() - mark
        timing["replayed_runs"] = float(len(manifests) - (held or 0))
        if d.rank == 0:  # (a resume, or launches that keep no engine: say what the cadence cost)
            _log.info(f"optimize: replayed {len(manifests) - (held or 0)} optimize run(s) since the last saved "
                      f"train state ({state or 'none: from the start'}) in {timing['replay_s']:.1f} s; "
                      "optimize.state_every sets how often it is saved")
    return _fit(E, engines, config, dscfg, state, d.rank, beside), tokenizer


def _fit(E: Any, engines: Engines | None, config: OptimizeConfig, dscfg: dict[str, Any], state: Path | None,
         rank: int, beside: Path) -> Engines:
    """`engines` when built with `config`'s knobs; else new engines with them holding the same
    state (through a DeepSpeed checkpoint in a scratch folder beside the output), or, given none,
    new engines continued from `state` (None: fresh)."""
    knobs = engine_knobs(config, dscfg)
    if engines is not None and engines.knobs == knobs:
        return engines
    if engines is None:
        return build(E, config, dscfg, state)
    from rlpipe.stages.optimize.state import save_engines

    scratch = beside.with_name(f".{beside.name}.engine-transfer")  # (shared by the ranks, like the output)
    if rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
    try:
        save_engines(engines.roles(), scratch, rank, engines.rng)
        engines.destroy()
        return build(E, config, dscfg, scratch)
    finally:
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)


def build(E: Any, config: OptimizeConfig, dscfg: dict[str, Any], state: Path | None) -> Engines:
    """Fresh engines from `config`'s policy (and critic), continued from the train state `state`
    (DeepSpeed load_checkpoint) when given."""
    from rlpipe.stages.common.deepspeed import number_parameters_from_zero
    from rlpipe.stages.common.models import load_model
    from rlpipe.stages.optimize.core import lr_factor

    number_parameters_from_zero()  # (ZeRO-3's saved state names its parameters by number)
    # Trainable copies: never train a model from the shared in-process cache.
    policy = load_model(config.policy, cache=False)[0]
    if config.lora is not None:  # the adapters (and, continued from a state, the base) come from the state
        from rlpipe.stages.optimize.lora import wrap

        policy = wrap(policy, **config.lora.model_dump(), seed=config.seed)

    def schedule(s: int) -> float:
        return lr_factor(s, config.lr_schedule, warmup_steps=config.warmup_steps, total_steps=config.total_steps,
                         min_lr_ratio=config.min_lr_ratio)

    pol = E.make_engine(policy, lr=config.lr, weight_decay=config.weight_decay, betas=config.betas,
                        config=dscfg, gradient_checkpointing=config.gradient_checkpointing, lr_lambda=schedule)
    crit = None
    if config.critic is not None:
        crit = E.make_engine(_load_critic(config.critic, config.seed), lr=config.critic_lr,
                             weight_decay=config.weight_decay, betas=config.betas, config=dscfg,
                             gradient_checkpointing=config.gradient_checkpointing, lr_lambda=schedule)
    engines = Engines(pol, crit, engine_knobs(config, dscfg))
    if state is not None:
        from rlpipe.stages.optimize.lora import check_state
        from rlpipe.stages.optimize.state import load_engines

        if (state / "_manifest.json").is_file():  # (a scratch transfer has no manifest)
            check_state(state, config.resolved()["lora"])
        engines.rng = load_engines(engines.roles(), state)
    return engines


def _load_critic(path: Path, seed: int) -> torch.nn.Module:
    """A trainable `ScalarHeadModel` critic (any architecture): a critic / reward checkpoint as
    saved, or a causal LM's backbone with a new head initialised N(0, 1 / (H + 1)^2) from `seed`."""
    from transformers.utils import logging as hf_logging

    from rlpipe.stages.common.scalar_head import load_scalar_head_model

    hf_logging.disable_progress_bar()
    return load_scalar_head_model(path, "critic", new_head="normal", seed=seed)


# -- the replayed runs ---------------------------------------------------------------------------
#: The inputs a replayed run reads (the state it continues from is the engines').
_REPLAYED_INPUTS = ("policy", "critic", "rollouts", "advantages", "reference")


def _chained(config: OptimizeConfig, inputs: dict[str, InputRef], i: int) -> Manifest:
    """The manifest of `replay[i]`, once its optimize run is known to have continued from the
    state this run's chain has there (the same train_state, the same replayed runs before it)."""
    path = Path(config.replay[i])
    manifest = read_manifest(path)
    where = _where(path, i)
    if manifest.stage != "optimize" or manifest.extra.get("kind") != "causal":
        raise UserError(f"{where}: not a policy checkpoint written by the optimize stage (stage "
                        f"{manifest.stage!r}); list the policy checkpoints written after train_state, oldest first")
    # It read the same train_state and replayed the same checkpoints before it as this run does.
    chain = {name: ref.content_hash for name, ref in inputs.items() if _in_chain(name, before=i)}
    recorded = {name: ref.content_hash for name, ref in manifest.inputs.items() if _in_chain(name)}
    if chain != recorded:
        raise UserError(f"{where}: its optimize run continued from {_describe(manifest.inputs)}, but this run has "
                        f"{_describe(inputs, i)} before it; replay must list the policy checkpoints written after "
                        "train_state (by runs that saved no state), oldest first")
    return manifest


def _in_chain(name: str, before: int | None = None) -> bool:
    """Whether the input `name` is part of the state a run continues from: its train_state, or
    one of its replay checkpoints (those before index `before`, when given)."""
    field, index = split_list_item(name)
    if field == "train_state":
        return True
    return field == "replay" and index is not None and (before is None or index < before)


def _where(path: Path, i: int) -> str:
    return f"optimize.replay[{i}] ({path})"


def _replayed_config(manifest: Manifest, path: Path, i: int) -> OptimizeConfig:
    """The config the optimize run that wrote `path` (replay[i]) had, its inputs where they are now."""
    where = _where(path, i)
    found = {name: _find(manifest, name, path, where) for name in _REPLAYED_INPUTS if name in manifest.inputs}
    try:
        step = OptimizeConfig.model_validate({**manifest.config, **{name: None for name in _REPLAYED_INPUTS},
                                              **found, "train_state": None, "replay": []})
    except ValueError as e:
        raise UserError(f"{where}: the config its manifest records is not a valid optimize config now: {e}") from None
    return step


def _describe(inputs: dict[str, InputRef], before: int | None = None) -> str:
    state = inputs.get("train_state")
    replayed = [ref.path for name, ref in inputs.items() if name != "train_state" and _in_chain(name, before)]
    return f"train_state {state.path if state else None} and replay {replayed}"


def _find(manifest: Manifest, name: str, checkpoint: Path, where: str) -> str:
    """Where the input `name` the replayed run read is now: at its recorded path, or, moved along
    with the checkpoint (a moved or copied run folder, a relative path from another directory), at
    the same place relative to it; with the recorded content either way."""
    from rlpipe.stages.common.models import checkpoint_key

    ref = manifest.inputs[name]
    written_to = Path(manifest.config["output"])
    candidates = [Path(ref.path), Path(os.path.normpath(checkpoint / os.path.relpath(ref.path, written_to)))]
    for candidate in candidates:
        try:
            if name in ("policy", "critic"):
                content = checkpoint_key(candidate) if candidate.is_dir() else None
            else:
                content = read_manifest(candidate).content_hash
        except Exception:  # missing or unreadable: try the next place
            content = None
        if content == ref.content_hash:
            return str(candidate)
    raise UserError(f"{where}: replaying its optimize run needs its input {name} ({ref.path}, content "
                    f"{ref.content_hash[:12]}), found neither there nor at {candidates[1]} with that content: "
                    "it was deleted or changed. Restore it, or rerun from the last saved train_state by "
                    "deleting the policy checkpoints after it")


def check_replayed(engines: Engines, checkpoint: Path, manifest: Manifest, tokenizer: Any) -> None:
    """The replayed policy's weights equal the saved checkpoint's, bit for bit (see the module doc);
    for a checkpoint whose weights were never written, their bytes hash to what its manifest lists."""
    from safetensors.torch import load_file

    from rlpipe.stages.common.deepspeed import full_parameters

    if manifest.not_written:
        _check_replayed_hashes(engines, checkpoint, manifest, tokenizer)
        return
    saved: dict[str, torch.Tensor] = {}
    for file in sorted(Path(checkpoint).glob("*.safetensors")):
        saved.update(load_file(file))
    with full_parameters(engines.policy) as module:
        if manifest.config.get("lora") is not None:
            from rlpipe.stages.optimize.lora import merged_state_dict

            replayed = merged_state_dict(module)
        else:
            replayed = module.state_dict()
        differ = {}
        for name, weight in saved.items():
            mine = replayed.get(name)
            if mine is None or mine.shape != weight.shape:
                differ[name] = float("inf")
            elif not torch.equal(mine.detach().to("cpu", weight.dtype), weight):
                differ[name] = float((mine.detach().to("cpu", torch.float64) - weight.double()).abs().max())
    if differ:
        worst = max(differ, key=differ.get)
        raise _other_weights(checkpoint, f"it holds: {len(differ)} of {len(saved)} tensors differ (max |diff| "
                                         f"{differ[worst]:.3g}, in {worst})")


def _check_replayed_hashes(engines: Engines, checkpoint: Path, manifest: Manifest, tokenizer: Any) -> None:
    """The replayed policy's weight files, as `hand_over` would write them, hash to the entries the
    manifest of `checkpoint` lists for the files it never wrote."""
    from rlpipe.stages.common.deepspeed import full_parameters
    from rlpipe.stages.common.handoff import weight_files

    with full_parameters(engines.policy) as module:
        replayed = weight_files(module, tokenizer, manifest.config["max_shard_size"])
    listed = {f.name: f for f in manifest.files if f.name in manifest.not_written}
    differ = sorted(name for name in listed.keys() | replayed.keys() if name not in listed or name not in replayed
                    or replayed[name].tagged_digest != listed[name].tagged_digest)
    if differ:
        raise _other_weights(checkpoint, f"its manifest records (weights held in memory only, "
                                         f"optimize.policy_weights: with_train_state): {', '.join(differ)} differ")


def _other_weights(checkpoint: Path, found: str) -> UserError:
    return UserError(
        f"replaying the optimize runs up to {checkpoint} gave other weights than {found}. An input of a replayed "
        "run changed, or the steps are not deterministic (another world size, ZeRO stage, dtype or device than the "
        "run that wrote it; nondeterministic GPU kernels). Rerun on the setup that wrote it, or delete the policy "
        "checkpoints after the last saved train_state to recompute them")
