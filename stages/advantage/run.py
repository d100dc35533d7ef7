"""The advantage stage: scores (+ rollouts, + reference) -> advantages.

Reads the whole scores artifact (group estimators need every sample of a group; the artifact is
small), joins behaviour log-probs (rollouts) and reference log-probs / critic values (reference)
by key, applies the KL penalty to the reward when configured, runs the registered estimator, and
writes one advantages shard per scores shard with the same index and row order.

Greedy baseline rows (sample_index -1, rollout `greedy_baseline: true`) are no samples: their
(KL-penalised) reward is the baseline of their group (`AdvantageInputs.baselines`, read by remax),
and they get no advantages row, so optimize never trains on them.
"""

from __future__ import annotations

import json
import time

import pyarrow as pa
import pyarrow.compute as pc
import torch

from rlpipe.schemas import (
    ADVANTAGES,
    REFERENCE,
    ROLLOUTS,
    SCORES,
    ArtifactWriter,
    Manifest,
    iter_shards,
    read_table_artifact,
)
from rlpipe.schemas.columns import LOGPROBS
from rlpipe.schemas.config_files import ConfigError
from rlpipe.schemas.errors import DataError
from rlpipe.schemas.rollouts import GREEDY_SAMPLE_INDEX
from rlpipe.stages.advantage.config import AdvantageConfig
from rlpipe.stages.advantage.estimators import AdvantageInputs, compute_advantages
from rlpipe.stages.advantage.kl import kl, kl_token_rewards, last_token_rewards, next_kl_beta
from rlpipe.stages.advantage.stats import advantage_summary
from rlpipe.stages.common.stage_io import StageStart, opens
from rlpipe.stages.common.tables import (
    KEY,
    align,
    compact,
    expand,
    length_mask,
    list_array,
    padded,
    sampled_mask,
    shard_index,
)

SCORE_COLUMNS = ["run", "prompt_id", *KEY, "response_length", "reward"]


@opens("advantage")
def run(config: AdvantageConfig, start: StageStart) -> Manifest:
    """Compute the advantages artifact of `config`; a cache hit returns the existing manifest."""
    inputs, key = start.inputs, start.key
    started = start.started

    # 1. Read: scores shard by shard (their boundaries are the output's), the others joined by key.
    shards = list(iter_shards(config.scores, SCORES, columns=SCORE_COLUMNS))
    scores = pa.concat_tables([t for _, t in shards]) if shards else SCORES.arrow().empty_table().select(SCORE_COLUMNS)
    rewards = torch.tensor(scores.column("reward").to_pylist(), dtype=torch.float64)
    mask = length_mask(torch.tensor(scores.column("response_length").to_pylist(), dtype=torch.long))
    pairs = torch.tensor([scores.column(k).to_pylist() for k in ("iteration", "group_id")], dtype=torch.long).T
    # One id per (iteration, group_id) pair: an artifact may hold several iterations.
    group_ids = torch.unique(pairs.reshape(-1, 2), dim=0, return_inverse=True)[1] if len(rewards) else pairs[:, 0]
    behaviour = ref_logp = values = sampled = None
    if config.rollouts is not None:
        rollouts = align(read_table_artifact(config.rollouts, ROLLOUTS, columns=[*KEY, "response_logprobs",
                                                                                 "response_mask"]),
                         scores, source=config.rollouts)
        behaviour = padded(rollouts.column("response_logprobs"), mask, what=f"{config.rollouts}: response_logprobs")
        sampled = sampled_mask(rollouts.column("response_mask"), mask, what=f"{config.rollouts}: response_mask")
    if config.reference is not None:
        reference = align(read_table_artifact(config.reference, REFERENCE, columns=[*KEY, "ref_logprobs", "values"]),
                          scores, source=config.reference)
        if reference.num_rows and reference.column("ref_logprobs").null_count < reference.num_rows:
            ref_logp = padded(reference.column("ref_logprobs"), mask, what=f"{config.reference}: ref_logprobs")
        if reference.num_rows and reference.column("values").null_count < reference.num_rows:
            values = padded(reference.column("values"), mask, what=f"{config.reference}: values")

    # Episodes (multi-turn rollouts): everything below sees only the tokens the model sampled, as
    # if the environment's had never been there (a GAE scan goes from one sampled token to the next),
    # and the results are put back in place (0 on the environment's tokens) when written.
    full_mask = mask
    if sampled is not None:
        mask = length_mask(sampled.sum(-1).long())
        behaviour, ref_logp, values = (compact(x, sampled) if x is not None else None
                                       for x in (behaviour, ref_logp, values))

    # 2. Per-token KL to the reference, and the rewards the estimator sees.
    kl_t = kl(config.kl.estimator, behaviour, ref_logp) * mask if behaviour is not None and ref_logp is not None else None
    if config.kl.in_reward:
        if kl_t is None:
            raise ConfigError(f"kl.in_reward: {config.reference} holds no reference log-probs (ref_logprobs is null)")
        token_rewards = kl_token_rewards(rewards, kl_t, mask, config.kl.beta)  # -beta kl_t, + R at the end
        seq_rewards = token_rewards.sum(-1)  # R - beta * sum_t kl_t
    else:
        token_rewards, seq_rewards = last_token_rewards(rewards, mask), rewards
    estimator = config.estimator
    if estimator.needs_values and values is None:
        raise ConfigError(f"estimator {estimator.name!r}: {config.reference} holds no critic values "
                         "(run the reference step with `critic=`)")

    # 3. Set the greedy baseline rows apart (a baseline per group), then estimate on the samples.
    greedy = torch.tensor(scores.column("sample_index").to_pylist(), dtype=torch.long) == GREEDY_SAMPLE_INDEX
    baselines = _group_baselines(seq_rewards, group_ids, greedy, scores, config) if greedy.any() else None
    if estimator.needs_baselines and baselines is None:
        raise ConfigError(f"estimator {estimator.name!r}: {config.scores} holds no greedy baseline rows "
                         f"(sample_index {GREEDY_SAMPLE_INDEX}): sample the rollouts with `greedy_baseline: true`")
    keep = ~greedy
    rewards, group_ids, mask, seq_rewards, token_rewards, full_mask = (
        x[keep] for x in (rewards, group_ids, mask, seq_rewards, token_rewards, full_mask))
    values, ref_logp, kl_t, sampled = (x[keep] if x is not None else None for x in (values, ref_logp, kl_t, sampled))
    out = compute_advantages(estimator, AdvantageInputs(seq_rewards, group_ids, mask, token_rewards, values, baselines))

    def in_place(x: torch.Tensor | None) -> torch.Tensor | None:  # back to the rollouts' token positions
        return expand(x, sampled) if x is not None and sampled is not None else x

    # 4. Write one shard per scores shard, same index and row order.
    knobs = estimator.model_dump(mode="json", exclude={"name"})
    params = json.dumps({**knobs, "kl_estimator": config.kl.estimator, "kl_in_reward": config.kl.in_reward,
                         "kl_beta": config.kl.beta}, sort_keys=True)
    columns = {
        "advantage": pa.array(out.advantages.tolist() if out.advantages is not None else [None] * len(rewards), pa.float32()),
        "token_advantages": list_array(in_place(out.token_advantages), full_mask),
        "returns": _list_or_null(in_place(out.returns), full_mask),
        "values": _list_or_null(in_place(values), full_mask),
        "ref_logprobs": _list_or_null(in_place(ref_logp), full_mask),
        "kl": _list_or_null(in_place(kl_t), full_mask),
    }
    writer = ArtifactWriter(config.output, ADVANTAGES, stage="advantage", config=config.resolved(),
                            inputs=inputs, cache_key=key)
    start = 0
    for path, table in shards:
        table = table.filter(pc.not_equal(table.column("sample_index"), GREEDY_SAMPLE_INDEX))
        n = table.num_rows
        shard = {name: table.column(name) for name in ("run", "iteration", "prompt_id", "group_id", "sample_index")}
        shard["reward"] = table.column("reward")
        shard.update({name: col.slice(start, n) for name, col in columns.items()})
        shard["estimator"] = pa.array([estimator.name] * n, pa.string())
        shard["estimator_params"] = pa.array([params] * n, pa.string())
        writer.write_shard(shard, index=shard_index(path))
        start += n

    extra = advantage_summary(rewards, group_ids, mask, out, kl_t)
    extra.update(estimator=estimator.name, kl_beta=config.kl.beta)
    if baselines is not None:
        extra.update(greedy_rows=int(greedy.sum()), baseline_reward_mean=float(baselines.mean()) if len(baselines) else 0.0)
    if "kl_seq_mean" in extra:
        extra["kl_beta_next"] = next_kl_beta(config.kl.controller, config.kl.beta, extra["kl_seq_mean"],
                                             target=config.kl.target, n_steps=len(rewards),
                                             horizon=config.kl.horizon)
    return writer.commit(extra=extra, wall_time_s=time.time() - started)


def _group_baselines(seq_rewards: torch.Tensor, group_ids: torch.Tensor, greedy: torch.Tensor, scores: pa.Table,
                     config: AdvantageConfig) -> torch.Tensor:
    """b_g of every sample: the (KL-penalised) reward of its group's one greedy row.

    Shape:
        seq_rewards, group_ids, greedy: (B,) over all rows; result: (number of samples,).
    """
    n_groups = int(group_ids.max()) + 1
    count = torch.zeros(n_groups, dtype=torch.long).index_add_(0, group_ids[greedy], torch.ones_like(group_ids[greedy]))
    bad = (count[group_ids] != 1).nonzero()
    if len(bad):
        i = int(bad[0])
        where = {k: scores.column(k)[i].as_py() for k in ("iteration", "group_id")}
        raise DataError(f"{config.scores}: group {where} has {int(count[group_ids[i]])} greedy baseline rows "
                         f"(sample_index {GREEDY_SAMPLE_INDEX}); a rollout with greedy_baseline gives every group one")
    base = torch.zeros(n_groups, dtype=seq_rewards.dtype).index_add_(0, group_ids[greedy], seq_rewards[greedy])
    return base[group_ids[~greedy]]


def _list_or_null(x: torch.Tensor | None, mask: torch.Tensor) -> pa.Array:
    return list_array(x, mask) if x is not None else pa.nulls(mask.shape[0], type=LOGPROBS)
