"""Rollout stage: prompts + policy checkpoint -> rollouts artifact (G samples per prompt).

Group g of the iteration is prompt row (prompt_offset + g) % n_prompts, sampled with the seed
group_seed(seed, iteration, g). Shard k holds groups [k*S, (k+1)*S), all G samples of each, rows
ordered by (group_id, sample_index); batches of `batch_size` prompts never cross a shard, so the
bytes of a shard do not depend on which worker wrote it.

Scale-out: worker i of N (worker_index=i, worker_count=N) writes the shards k with k % N == i into
the shared output directory, then drops a marker file; the worker that finds all N markers of
this cache key writes the manifest listing every shard. A worker that is not last returns a
manifest of its own shards (not written; `extra.partial` is true).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa

from rlpipe.schemas import (
    ROLLOUTS,
    ArtifactWriter,
    Manifest,
    shard_name,
)
from rlpipe.schemas.config_files import ConfigError
from rlpipe.schemas.errors import DataError
from rlpipe.schemas.rollouts import GREEDY_SAMPLE_INDEX, sampled_lengths
from rlpipe.stages.common.progress import progress
from rlpipe.stages.common.stage_io import StageStart, opens
from rlpipe.stages.rollout.config import RolloutConfig
from rlpipe.stages.rollout.core import (
    chat_turns,
    group_seed,
    select_prompts,
    shard_ranges,
    templated_token_ids,
    worker_shards,
)
from rlpipe.stages.rollout.engines import Sample, SamplingSpec, get_engine
from rlpipe.stages.rollout.prompt_memory import PROMPT_MEMORY

STAGE = "rollout"


@opens(STAGE)
def run(config: RolloutConfig, start: StageStart) -> Manifest:
    inputs, key = start.inputs, start.key
    started = start.started

    prompts = PROMPT_MEMORY.read(config.prompts, inputs["prompts"].content_hash)  # (checked)
    rows = select_prompts(prompts.num_rows, config.group_count(), config.prompt_offset)
    groups = prompts.take(pa.array(rows, type=pa.int64())).to_pylist()
    shards = shard_ranges(len(groups), config.groups_per_shard)
    mine = worker_shards(len(shards), config.worker_index, config.worker_count)

    engine = get_engine(config.engine)(config.checkpoint, config)
    templated = _use_chat_template(engine, groups, config)
    token_ids = _tokenize(engine, groups, config, templated)
    # Inputs are valid: only now does the old artifact stop existing (manifest removed first).
    writer = ArtifactWriter(config.output, ROLLOUTS, stage=STAGE, config=config.resolved(),
                            inputs=inputs, cache_key=key, clean=config.worker_index is None)
    if config.worker_index is not None:
        writer.prepare_worker(config.worker_index, config.worker_count,
                              others=[shard_name(k) for k in range(len(shards)) if k not in mine])
    params = SamplingSpec(
        group_size=config.group_size, temperature=config.temperature, top_p=config.top_p,
        top_k=config.top_k, max_new_tokens=config.max_new_tokens, stop=tuple(config.stop),
        stop_token_ids=tuple(config.stop_token_ids),
    )
    # ReMax's baseline: one greedy response per prompt (no randomness: the seed plays no part).
    greedy = replace(params, group_size=1, temperature=0.0, top_p=1.0, top_k=0) if config.greedy_baseline else None
    episodes = _episode_runner(engine, config) if config.environment is not None else None
    files, gen_s, n_tokens = [], 0.0, 0
    who = "" if config.worker_index is None else f" worker {config.worker_index}/{config.worker_count}"
    with progress(f"rollout ({config.engine}){who}: groups", sum(len(shards[k]) for k in mine)) as advance:
        for k in mine:
            rows: dict[str, list[Any]] = {c: [] for c in ROLLOUTS.column_names}
            for start in range(shards[k].start, shards[k].stop, config.batch_size):
                ids = range(start, min(start + config.batch_size, shards[k].stop))
                seeds = [group_seed(config.seed, config.iteration, g) for g in ids]
                t0 = time.perf_counter()
                if episodes is None:
                    samples = [[_sample_row(s) for s in group]
                               for group in engine.generate([token_ids[g] for g in ids], seeds, params)]
                    baselines = ([[_sample_row(s) for s in group]
                                  for group in engine.generate([token_ids[g] for g in ids], seeds, greedy)]
                                 if greedy else [[]] * len(ids))
                else:
                    samples = episodes([groups[g] for g in ids], seeds, params)
                    baselines = episodes([groups[g] for g in ids], seeds, greedy) if greedy else [[]] * len(ids)
                gen_s += time.perf_counter() - t0
                for g, seed, group, baseline in zip(ids, seeds, samples, baselines, strict=True):
                    _append_group(rows, config, g, groups[g], token_ids[g], seed, group, baseline)
                advance(len(ids))
            shard = pa.table(rows)
            n_tokens += sum(_sampled(shard))  # the model's tokens: what generate_s was spent on
            files.append(writer.write_shard(shard, index=k))

    # Which policy sampled (its checkpoint and content hash are the `checkpoint` input): after how many
    # optimize runs, and how many iterations behind the one these rollouts train (async staleness).
    sampled_by = {"policy_version": config.policy_version, "staleness": config.iteration - config.policy_version,
                  "chat_template": templated}  # (the prompts went through it: a TRL reward sees messages)
    timing = {"generate_s": round(gen_s, 3), "generated_tokens": n_tokens,
              "tokens_per_s": round(n_tokens / gen_s, 1) if gen_s else None,
              "engine_start_s": round(engine.start_s, 3), "model_load": engine.model_load}
    if episodes is not None:  # the environment's share of generate_s
        timing |= {k: round(v, 6) for k, v in episodes.timing.items()}
    if config.worker_index is None:
        return writer.commit(extra=_summary(writer.staging, writer) | {"timing": timing, "sampled_by": sampled_by},
                             wall_time_s=time.time() - started)
    extra = {"worker_index": config.worker_index, "worker_count": config.worker_count, "timing": timing,
             "sampled_by": sampled_by}
    return writer.finish_worker(
        config.worker_index, config.worker_count, expected=[shard_name(k) for k in range(len(shards))],
        commit=lambda: writer.commit(extra=_summary(writer.staging, writer) | extra,
                                     wall_time_s=time.time() - started),
        extra=extra)


def _use_chat_template(engine, groups: list[dict[str, Any]], config: RolloutConfig) -> bool:
    """Whether prompts go through the tokenizer's chat template (see RolloutConfig.chat_template)."""
    from rlpipe.stages.rollout.environments.episode import (
        refuse_system_prompt_without_template,
        uses_chat_template,
    )

    use = uses_chat_template(engine.tokenizer, config.chat_template, config.checkpoint)
    if not use:
        chats = [i for i, row in enumerate(groups) if row["messages"]]
        if chats:
            why = "chat_template is false" if config.chat_template is False else \
                f"the tokenizer of {config.checkpoint} has no chat template"
            raise ConfigError(f"prompts artifact {config.prompts} gives prompts as chat messages "
                             f"(prompt_id {groups[chats[0]]['prompt_id']!r}, ...) but {why}: use a "
                             "checkpoint whose tokenizer has a chat template, or plain-text prompts")
        refuse_system_prompt_without_template(config.system_prompt, config.checkpoint)
    return use


def _tokenize(engine, groups: list[dict[str, Any]], config: RolloutConfig, templated: bool) -> list[list[int]]:
    """Prompt token ids per group (through the chat template when `templated`); every prompt must
    leave room for max_new_tokens."""
    cache: dict[str, list[int]] = {}
    out = []
    for row in groups:
        ids = cache.get(row["prompt_id"])
        if ids is None:
            if templated:
                turns = chat_turns(row["prompt"], row["messages"], config.system_prompt)
                ids = cache[row["prompt_id"]] = templated_token_ids(engine.tokenizer, turns)
            else:
                ids = cache[row["prompt_id"]] = list(engine.tokenizer(row["prompt"]).input_ids)
            if not ids:
                raise DataError(f"prompt {row['prompt_id']!r} of {config.prompts} has no tokens")
            need = len(ids) + config.max_new_tokens
            if need > engine.context_length:
                raise DataError(
                    f"prompt {row['prompt_id']!r} of {config.prompts} is too long: {len(ids)} tokens "
                    f"+ max_new_tokens {config.max_new_tokens} = {need} > the model's context of "
                    f"{engine.context_length} tokens ({config.checkpoint})"
                )
        out.append(ids)
    return out


def _sample_row(s: Sample) -> dict[str, Any]:
    """The response columns of a single-turn sample (the episode columns null)."""
    return {"response": s.text, "response_token_ids": s.token_ids, "response_logprobs": s.logprobs,
            "finish_reason": s.finish_reason}


def _episode_runner(engine, config: RolloutConfig):
    """The sampler of `config.environment`'s episodes (checked: a bad spec is a config error)."""
    from rlpipe.stages.rollout.environments.base import make_environment
    from rlpipe.stages.rollout.environments.episode import ChatTurns, EpisodeSampler, TextTurns

    try:
        make = make_environment(config.environment)
    except (ValueError, ImportError) as e:
        raise ConfigError(str(e)) from None  # (the message names the environment's key)
    if _use_chat_template(engine, [], config):
        turns = ChatTurns(engine.tokenizer, getattr(make(), "schemas", None), config.system_prompt)
    else:
        turns = TextTurns(engine.tokenizer)
    return EpisodeSampler(engine, make, turns, config.environment.max_turns)


def _append_group(rows: dict[str, list[Any]], config: RolloutConfig, group_id: int, prompt: dict[str, Any],
                  prompt_ids: list[int], seed: int, group: list[dict[str, Any]], greedy: list[dict[str, Any]]) -> None:
    """The group's rows in sample_index order: its greedy baseline (-1) if any, then samples 0..G-1.
    `group` and `greedy` hold each response's own columns (`_sample_row`, `episode_columns`)."""
    sampled = {"temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k,
               "max_new_tokens": config.max_new_tokens}
    argmax = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": config.max_new_tokens}
    for i, response, sampling in [*((GREEDY_SAMPLE_INDEX, s, argmax) for s in greedy),
                                  *((i, s, sampled) for i, s in enumerate(group))]:
        common = {
            "run": config.run, "iteration": config.iteration, "policy_version": config.policy_version,
            "prompt_id": prompt["prompt_id"], "group_id": group_id, "sample_index": i, "prompt": prompt["prompt"],
            "prompt_token_ids": prompt_ids, "answer": prompt["answer"], "sampling": sampling,
            "engine": config.engine, "seed": seed, "metadata": prompt["metadata"],
        }
        for col in ROLLOUTS.column_names:  # an episode's opening replaces the prompt's tokens
            rows[col].append(response[col] if col in response else common.get(col))


def _summary(path: Path, writer: ArtifactWriter) -> dict[str, Any]:
    """Counts over every shard in the directory (identical for 1 or N workers)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from rlpipe.schemas.table_memory import TABLES

    cols = ["group_id", "sample_index", "response_token_ids", "finish_reason", "response_mask", "num_turns", "turns"]

    def shard(p: Path) -> pa.Table:  # (this worker's own shards from memory: no decode)
        mine = writer.written(p.name)
        table = TABLES.get(mine.tagged_digest) if mine is not None else None
        return table.select(cols) if table is not None else pq.read_table(p, columns=cols)

    tables = [shard(p) for p in sorted(Path(path).glob("part-*.parquet"))]
    if not tables:
        return {"groups": 0, "samples": 0, "response_tokens": 0, "length_fraction": 0.0}
    t = pa.concat_tables(tables)
    greedy_rows = int(pc.sum(pc.equal(t["sample_index"], GREEDY_SAMPLE_INDEX)).as_py() or 0)
    t = t.filter(pc.not_equal(t["sample_index"], GREEDY_SAMPLE_INDEX))  # the statistics are the samples'
    lengths = _sampled(t)
    n = t.num_rows
    return {
        "groups": len(pc.unique(t["group_id"])),
        "samples": n,
        "response_tokens": sum(lengths),
        "response_length_mean": round(sum(lengths) / n, 3) if n else 0.0,
        "length_fraction": round(float(pc.sum(pc.equal(t["finish_reason"], "length")).as_py()) / n, 4),
        **({"greedy_rows": greedy_rows} if greedy_rows else {}),
        **(_episode_summary(t) if t["num_turns"].null_count < n else {}),
    }


def _sampled(t: pa.Table) -> list[int]:
    """Each row's count of tokens the model sampled (`sampled_lengths`: an episode's environment
    tokens left out)."""
    import pyarrow.compute as pc

    positions = pc.list_value_length(t["response_token_ids"]).to_pylist()
    return sampled_lengths(t["response_mask"], positions, what="rollouts: column 'response_mask'")


def _episode_summary(t: pa.Table) -> dict[str, Any]:
    """Turns and tool calls of the episodes in `t`."""
    import pyarrow.compute as pc

    turns = pc.list_flatten(t["turns"])
    calls = pc.list_flatten(pc.struct_field(turns, "tool_calls"))
    return {
        "turns_mean": round(float(pc.mean(t["num_turns"]).as_py()), 3),
        "tool_calls": len(calls),
        "tool_call_errors": int(pc.sum(pc.is_valid(pc.struct_field(calls, "error"))).as_py() or 0) if len(calls) else 0,
    }

