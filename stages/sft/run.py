"""sft stage: fine-tune a causal LM on prompt+answer text (the pipeline's warm start).

Reads a `prompts` artifact and a base checkpoint; writes a Hugging Face checkpoint (+ tokenizer,
+ `_manifest.json` written last) and a `metrics` artifact with the loss curve.

    python -m rlpipe.stages.base_model.run=ckpt/base prompts=task/train output=runs/x/sft max_steps=300
    torchrun --nproc_per_node 2 -m rlpipe.stages.sft -c sft.yaml       # 2 ranks, gloo on CPU
"""

from __future__ import annotations

import logging
import time

from rlpipe.schemas import (
    METRICS,
    PROMPTS,
    Manifest,
    commit_directory,
    read_manifest,
    read_table_artifact,
    write_table_artifact,
)
from rlpipe.schemas.config_files import ConfigError
from rlpipe.schemas.errors import DataError
from rlpipe.schemas.staging import staged_directory
from rlpipe.stages.common.forward import packs
from rlpipe.stages.common.stage_io import StageStart, opens
from rlpipe.stages.sft.config import SFTConfig

_log = logging.getLogger(__name__)

STAGE = "sft"


@opens(STAGE)
def run(config: SFTConfig, start: StageStart) -> Manifest:
    import torch
    import transformers

    from rlpipe.stages.common import deepspeed as ds
    from rlpipe.stages.common.distributed import barrier, init_distributed
    from rlpipe.stages.common.models import keeps_saved_checkpoints, load_model, remember
    from rlpipe.stages.common.progress import progress
    from rlpipe.stages.sft import core

    inputs, key = start.inputs, start.key
    started = start.started
    transformers.utils.logging.disable_progress_bar()
    dist_info = init_distributed()
    rank, world = dist_info.rank, dist_info.world_size

    # Data: one example per prompts row (prompt+answer+EOS, or plain text when answer is null).
    model, tokenizer = load_model(config.base, cache=False)
    table = read_table_artifact(config.prompts, PROMPTS, columns=["prompt", "answer", "messages"])
    prompts, answers = table.column("prompt").to_pylist(), table.column("answer").to_pylist()
    if not prompts:
        raise DataError(f"{config.prompts}: the prompts artifact has no rows to train on")
    turns = _chat_turns(tokenizer, config)
    if turns is None:
        prompt_ids = tokenizer(prompts).input_ids
        examples = [_encode(tokenizer, p, a, config) for p, a in zip(prompt_ids, answers, strict=True)]
    else:  # through the chat template, as the episodes lay the same turns out
        examples = [_encode_chat(turns, tokenizer, p, m, a, config)
                    for p, m, a in zip(prompts, table.column("messages").to_pylist(), answers, strict=True)]
    steps = core.num_steps(len(examples), config.batch_size, config.epochs, config.max_steps)
    schedule = core.batch_schedule(len(examples), config.batch_size, steps, config.seed)

    # Engine: fp32, AdamW, warm-up + decay, ZeRO stage from the config.
    torch.manual_seed(config.seed)
    model.train()
    if config.batch_size % world:
        raise ConfigError(f"batch_size {config.batch_size} does not divide by the world size {world}")
    micro = config.batch_size // world
    engine = ds.make_engine(
        model, ds.ds_config(config.zero_stage, micro_batch_size=micro, grad_accum=1, world_size=world,
                            grad_clip=config.grad_clip),
        optimizer=lambda params: torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay),
        lr_lambda=lambda s: core.lr_factor(s, steps, config.warmup_steps, config.lr_schedule),
    )
    rows: list[tuple[int, str, float]] = []
    packed = config.packing and packs(model)
    with progress("sft", steps, enabled=rank == 0) as advance:
        for step, idx in enumerate(schedule):
            batch = [examples[i] for i in idx]
            n_targets = sum(e.num_targets for e in batch)  # global: every rank sees the whole batch
            mine = batch[rank * micro:(rank + 1) * micro]
            if packed:  # (no padding: position ids restart at each example, forward.PackedRows)
                input_ids, position_ids, labels = core.collate_packed(mine, tokenizer.pad_token_id)
                layout = {"position_ids": position_ids.to(engine.device), "use_cache": False}
            else:
                input_ids, attention_mask, labels = core.collate(mine, tokenizer.pad_token_id)
                layout = {"attention_mask": attention_mask.to(engine.device)}
            lr = engine.get_lr()[0]
            logits = engine(input_ids=input_ids.to(engine.device), **layout).logits
            loss = core.sft_loss(logits, labels.to(engine.device), n_targets, world)
            engine.backward(loss)
            engine.step()
            # The logged loss is the global token-mean (sum of the ranks' parts / world).
            loss_value = _mean_over_ranks(loss.detach(), world)
            rows += [(step, "loss", loss_value), (step, "lr", lr), (step, "target_tokens", float(n_targets))]
            advance(loss=loss_value)

    # Checkpoint, then the metrics artifact, then the checkpoint's manifest, all staged: the
    # checkpoint at config.output is replaced only once the new one is complete.
    manifest = None
    with staged_directory(config.output, write=rank == 0) as staging:
        trained = ds.save_pretrained(engine, tokenizer, staging, rank, keep_copy=keeps_saved_checkpoints())
        train_time = time.time() - started
        losses = [v for _, n, v in rows if n == "loss"]
        summary = {"steps": steps, "examples": len(examples), "world_size": world,
                   "first_loss": losses[0], "final_loss": losses[-1], "train_time_s": round(train_time, 3)}
        if rank == 0:
            write_table_artifact(
                config.metrics_path, METRICS,
                # Times stay out of the rows (they are in the manifests) so equal runs give equal content.
                {"run": [config.run] * len(rows), "iteration": [config.iteration] * len(rows),
                 "stage": [STAGE] * len(rows), "step": [s for s, _, _ in rows],
                 "name": [n for _, n, _ in rows], "value": [v for _, _, v in rows]},
                stage=STAGE, config=config.resolved(), inputs=inputs, cache_key=key,
            )
            manifest = commit_directory(staging, stage=STAGE, config=config.resolved(), inputs=inputs,
                                        cache_key=key, extra=summary, wall_time_s=train_time)
    if trained is not None:
        remember(config.output, "causal", trained, tokenizer)  # warm for the next stage in this process
        _log.info(f"sft: {steps} steps on {len(examples)} examples, loss {losses[0]:.4f} -> {losses[-1]:.4f} "
                  f"(final), {train_time:.1f} s")
    engine.destroy()
    barrier()
    return manifest if manifest is not None else read_manifest(config.output)


def _encode(tokenizer, prompt_ids: list[int], answer: str | None, config: SFTConfig):
    """One example: the answer's segments (tool replies untrained) tokenised one by one."""
    from rlpipe.stages.sft import core

    if answer is None:
        return core.encode_example(prompt_ids, None, tokenizer.eos_token_id, config.max_length, config.loss_on)
    segments = core.answer_segments(answer, config.mask_tool_responses)
    ids, trained = core.encode_answer(lambda text: tokenizer(text, add_special_tokens=False).input_ids, segments)
    return core.encode_example(prompt_ids, ids, tokenizer.eos_token_id, config.max_length, config.loss_on, trained)


def _chat_turns(tokenizer, config: SFTConfig):
    """The episodes' chat layout (`ChatTurns`, with the environment's tools and the system
    prompt) when the examples go through the chat template (`config.chat_template`), else None."""
    from rlpipe.stages.rollout.environments.base import make_environment
    from rlpipe.stages.rollout.environments.episode import (
        ChatTurns,
        refuse_system_prompt_without_template,
        uses_chat_template,
    )

    if not uses_chat_template(tokenizer, config.chat_template, config.base):
        refuse_system_prompt_without_template(config.system_prompt, config.base)
        return None

    tools = None
    if config.environment is not None:
        try:
            tools = getattr(make_environment(config.environment)(), "schemas", None)
        except (ValueError, ImportError) as e:
            raise ConfigError(str(e)) from None  # (the message names the environment's key)
    return ChatTurns(tokenizer, tools, config.system_prompt)


def _encode_chat(turns, tokenizer, prompt: str, messages: list[dict] | None, answer: str | None, config: SFTConfig):
    """One example through the chat template (stages/sft/chat.py); a row without an answer is
    plain text, trained on every token."""
    from rlpipe.stages.sft import chat, core

    if answer is None:
        return core.encode_example(tokenizer(prompt).input_ids, None, tokenizer.eos_token_id, config.max_length,
                                   config.loss_on)
    opening = list(messages) if messages else [{"role": "user", "content": prompt}]
    segments = core.answer_segments(answer, config.mask_tool_responses)
    return chat.chat_example(turns, opening, segments, lambda text: tokenizer(text, add_special_tokens=False).input_ids,
                             config.max_length, config.loss_on)


def _mean_over_ranks(x, world: int) -> float:
    import torch.distributed as dist

    if world > 1:
        dist.all_reduce(x)
    return float(x) / world
