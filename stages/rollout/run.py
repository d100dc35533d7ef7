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
from pathlib import Path
from typing import Any

import pyarrow as pa

from rlpipe.schemas import (
    PROMPTS,
    ROLLOUTS,
    ArtifactWriter,
    Manifest,
    cache_key,
    cached_manifest,
    read_manifest,
    read_table_artifact,
    shard_name,
)
from rlpipe.stages.rollout.config import RolloutConfig
from rlpipe.stages.rollout.core import group_seed, select_prompts, shard_ranges, worker_shards
from rlpipe.stages.rollout.engines import Sample, SamplingSpec, get_engine

STAGE = "rollout"
#: Fields that decide who writes which shard, never what a shard contains.
_PLACEMENT = ("worker_index", "worker_count")


def run(config: RolloutConfig, *, force: bool = False) -> Manifest:
    started = time.time()
    inputs = {"prompts": read_manifest(config.prompts).as_input(config.prompts),
              "policy": _checkpoint_input(config.checkpoint)}
    content = {k: v for k, v in config.resolved().items() if k not in _PLACEMENT}
    key = cache_key(STAGE, content, {role: ref.content_hash for role, ref in inputs.items()})
    cached = cached_manifest(config.output, key)
    if cached is not None and not force:
        return cached

    prompts = read_table_artifact(config.prompts, PROMPTS).to_pylist()
    if not prompts:
        raise ValueError(f"prompts artifact {config.prompts} has no rows: nothing to sample")
    groups = [prompts[i] for i in select_prompts(len(prompts), config.num_prompts, config.prompt_offset)]
    shards = shard_ranges(len(groups), config.groups_per_shard)
    mine = worker_shards(len(shards), config.worker_index, config.worker_count)

    engine = get_engine(config.engine)(config.checkpoint, config)
    token_ids = _tokenize(engine, groups, config)
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
    files, gen_s, n_tokens = [], 0.0, 0
    with _progress(sum(len(shards[k]) for k in mine), config) as advance:
        for k in mine:
            rows: dict[str, list[Any]] = {c: [] for c in ROLLOUTS.column_names}
            for start in range(shards[k].start, shards[k].stop, config.batch_size):
                ids = range(start, min(start + config.batch_size, shards[k].stop))
                seeds = [group_seed(config.seed, config.iteration, g) for g in ids]
                t0 = time.perf_counter()
                samples = engine.generate([token_ids[g] for g in ids], seeds, params)
                gen_s += time.perf_counter() - t0
                for g, seed, group in zip(ids, seeds, samples, strict=True):
                    n_tokens += sum(len(s.token_ids) for s in group)
                    _append_group(rows, config, g, groups[g], token_ids[g], seed, group)
                advance(len(ids))
            files.append(writer.write_shard(pa.table(rows), index=k))

    timing = {"generate_s": round(gen_s, 3), "generated_tokens": n_tokens,
              "tokens_per_s": round(n_tokens / gen_s, 1) if gen_s else None,
              "engine_start_s": round(engine.start_s, 3)}
    if config.worker_index is None:
        return writer.commit(extra=_summary(writer.staging, writer) | {"timing": timing},
                             wall_time_s=time.time() - started)
    extra = {"worker_index": config.worker_index, "worker_count": config.worker_count, "timing": timing}
    return writer.finish_worker(
        config.worker_index, config.worker_count, expected=[shard_name(k) for k in range(len(shards))],
        commit=lambda: writer.commit(extra=_summary(writer.staging, writer) | extra,
                                     wall_time_s=time.time() - started),
        extra=extra)


def _checkpoint_input(path: Path):
    """The policy as an input: its manifest, or (a plain Hugging Face directory) its file identity."""
    from rlpipe.schemas import InputRef, exists
    from rlpipe.stages.common.models import checkpoint_key

    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"policy checkpoint {path} does not exist (no config.json there)")
    if exists(path):
        return read_manifest(path).as_input(path)
    return InputRef(path=str(path), content_hash=checkpoint_key(path))


def _tokenize(engine, groups: list[dict[str, Any]], config: RolloutConfig) -> list[list[int]]:
    """Prompt token ids per group; every prompt must leave room for max_new_tokens."""
    cache: dict[str, list[int]] = {}
    out = []
    for row in groups:
        ids = cache.get(row["prompt_id"])
        if ids is None:
            ids = cache[row["prompt_id"]] = list(engine.tokenizer(row["prompt"]).input_ids)
            if not ids:
                raise ValueError(f"prompt {row['prompt_id']!r} of {config.prompts} has no tokens")
            need = len(ids) + config.max_new_tokens
            if need > engine.context_length:
                raise ValueError(
                    f"prompt {row['prompt_id']!r} of {config.prompts} is too long: {len(ids)} tokens "
                    f"+ max_new_tokens {config.max_new_tokens} = {need} > the model's context of "
                    f"{engine.context_length} tokens ({config.checkpoint})"
                )
        out.append(ids)
    return out


def _append_group(rows: dict[str, list[Any]], config: RolloutConfig, group_id: int,
                  prompt: dict[str, Any], prompt_ids: list[int], seed: int, group: list[Sample]) -> None:
    sampling = {"temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k,
                "max_new_tokens": config.max_new_tokens}
    for i, s in enumerate(group):
        for col, value in (
            ("run", config.run), ("iteration", config.iteration),
            ("policy_version", config.policy_version), ("prompt_id", prompt["prompt_id"]),
            ("group_id", group_id), ("sample_index", i), ("prompt", prompt["prompt"]),
            ("prompt_token_ids", prompt_ids), ("answer", prompt["answer"]), ("response", s.text),
            ("response_token_ids", s.token_ids), ("response_logprobs", s.logprobs),
            ("finish_reason", s.finish_reason), ("sampling", sampling), ("engine", config.engine),
            ("seed", seed),
        ):
            rows[col].append(value)


def _summary(path: Path, writer: ArtifactWriter) -> dict[str, Any]:
    """Counts over every shard in the directory (identical for 1 or N workers)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    cols = ["group_id", "response_token_ids", "finish_reason"]
    tables = [pq.read_table(p, columns=cols) for p in sorted(Path(path).glob("part-*.parquet"))]
    if not tables:
        return {"groups": 0, "samples": 0, "response_tokens": 0, "length_fraction": 0.0}
    t = pa.concat_tables(tables)
    lengths = pc.list_value_length(t["response_token_ids"])
    n = t.num_rows
    return {
        "groups": len(pc.unique(t["group_id"])),
        "samples": n,
        "response_tokens": int(pc.sum(lengths).as_py() or 0),
        "response_length_mean": round(float(pc.mean(lengths).as_py() or 0.0), 3),
        "length_fraction": round(float(pc.sum(pc.equal(t["finish_reason"], "length")).as_py()) / n, 4),
    }


def _progress(total: int, config: RolloutConfig):
    """A rich progress bar over groups on stderr; yields advance(n)."""
    from contextlib import contextmanager

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    @contextmanager
    def bar():
        who = "" if config.worker_index is None else f" worker {config.worker_index}/{config.worker_count}"
        with Progress(TextColumn(f"rollout ({config.engine}){who}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("groups"), TimeElapsedColumn(),
                      console=Console(stderr=True), transient=False) as progress:
            task = progress.add_task("groups", total=total)
            yield lambda n: progress.advance(task, n)

    return bar()
