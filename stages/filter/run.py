"""The filter stage: scores -> the scores of the groups kept (dynamic sampling).

Reads the whole scores artifact (a group's rows may lie in any shard order; the artifact is
small), asks the predicate about each group's sampled rewards (greedy baseline rows, sample_index
-1, are no samples: they go with their group), picks the groups kept in group order, and writes
each scores shard's kept rows as the shard of the same index (a shard left empty is not written).
"""

from __future__ import annotations

import time
from typing import Any

import pyarrow as pa

from rlpipe.schemas import SCORES, ArtifactWriter, Manifest, iter_shards
from rlpipe.schemas.errors import DataError
from rlpipe.schemas.rollouts import GREEDY_SAMPLE_INDEX
from rlpipe.stages.common.stage_io import StageStart, opens
from rlpipe.stages.common.tables import shard_index
from rlpipe.stages.filter.config import FilterConfig
from rlpipe.stages.filter.predicates import drops

STAGE = "filter"


@opens(STAGE)
def run(config: FilterConfig, start: StageStart) -> Manifest:
    """Write the filtered scores of `config`."""
    shards = list(iter_shards(config.scores, SCORES))
    rows: dict[tuple[int, int], dict[str, Any]] = {}  # (iteration, group_id) -> prompt_id, sampled rewards
    for _, table in shards:
        for it, gid, pid, s, r in zip(*(table.column(c).to_pylist() for c in (
                "iteration", "group_id", "prompt_id", "sample_index", "reward")), strict=True):
            group = rows.setdefault((it, gid), {"prompt_id": pid, "rewards": []})
            if s != GREEDY_SAMPLE_INDEX:
                group["rewards"].append(r)
    order = sorted(rows)  # group order: (iteration, group_id) ascending
    dropped = [g for g in order if drops(config.drop, rows[g]["rewards"])]
    passed = [g for g in order if g not in set(dropped)]
    kept, surplus, refilled = choose_groups(passed, dropped, config.keep_groups, config.shortfall, config.scores)
    if not kept:
        raise DataError(f"{config.scores}: the predicate {config.drop.name!r} drops all {len(order)} groups: "
                         "nothing to train on (set keep_groups with shortfall 'refill', or another predicate)")

    keep = set(kept)
    family = SCORES.family_columns(shards[0][1].column_names) if shards else []
    writer = ArtifactWriter(config.output, SCORES, stage=STAGE, config=config.resolved(), inputs=start.inputs,
                            cache_key=start.key, extra_columns=[SCORES.column(c) for c in family])
    for path, table in shards:
        table = table.filter(pa.array([g in keep for g in zip(table.column("iteration").to_pylist(),
                                                               table.column("group_id").to_pylist(), strict=True)]))
        if table.num_rows:
            writer.write_shard(table, index=shard_index(path))

    def listed(groups: list[tuple[int, int]]) -> list[dict[str, Any]]:
        return [{"iteration": it, "group_id": gid, "prompt_id": rows[(it, gid)]["prompt_id"]} for it, gid in groups]

    dropped_out = [g for g in dropped if g not in set(refilled)]
    extra = {
        "groups_in": len(order), "groups_passed": len(passed), "groups_kept": len(kept),
        "groups_dropped": len(dropped_out), "groups_surplus": len(surplus), "groups_refilled": len(refilled),
        "dropped": listed(dropped_out), "surplus": listed(surplus), "refilled": listed(refilled),
    }
    return writer.commit(extra=extra, wall_time_s=time.time() - start.started)


def choose_groups(passed: list, dropped: list, keep_groups: int | None, shortfall: str,
                  source: Any) -> tuple[list, list, list]:
    """(kept, surplus, refilled): the first `keep_groups` of `passed` (all of them when None);
    the passing groups beyond it (surplus); and, when fewer pass and `shortfall` is 'refill', the
    first `dropped` groups that fill the batch up. All three in group order; kept is sorted."""
    if keep_groups is None:
        return passed, [], []
    kept, surplus = passed[:keep_groups], passed[keep_groups:]
    missing = keep_groups - len(kept)
    if missing > 0 and shortfall == "error":
        raise DataError(f"{source}: only {len(passed)} of {len(passed) + len(dropped)} groups pass the filter, "
                         f"fewer than keep_groups = {keep_groups}: raise the rollout's oversample, or set "
                         "shortfall: refill")
    refilled = dropped[:max(missing, 0)]
    return sorted(kept + refilled), surplus, refilled
