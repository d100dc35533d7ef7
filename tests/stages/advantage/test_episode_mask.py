"""Episodes in the advantage stage: the environment's tokens are as if they had never been there.

An episode of sampled tokens s1 s2 | env e1 e2 | s3 gives, on s1 s2 s3, exactly the advantages,
returns, values and KL that a single-turn response s1 s2 s3 gives (GAE with values and the KL in
the reward scan from one sampled token to the next), and 0 on e1 e2.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from rlpipe.schemas import REFERENCE, ROLLOUTS, SCORES
from rlpipe.stages.advantage.config import AdvantageConfig
from rlpipe.stages.advantage.run import run

from .conftest import reference_row, rollout_row, score_row, write_rows

pytestmark = pytest.mark.multiturn

#: Two groups of two: (sampled log-probs, ref log-probs, values, reward, where the environment's
#: tokens go in the episode (insert before sampled index k, how many)).
ROWS = [
    ([-0.5, -1.0, -0.2], [-0.6, -0.7, -0.4], [0.1, 0.3, 0.2], 1.0, (2, 2)),
    ([-0.3, -0.9], [-0.2, -1.1], [0.0, -0.1], 0.0, (1, 3)),
    ([-1.2, -0.1, -0.4, -0.8], [-1.0, -0.3, -0.4, -0.5], [0.5, 0.4, 0.2, 0.1], 1.0, (3, 1)),
    ([-0.7], [-0.9], [0.2], 0.5, (1, 2)),
]


def _write(root, episodes: bool) -> dict:
    rollouts, scores, reference, where = [], [], [], []
    for i, (logp, ref, values, reward, (k, n)) in enumerate(ROWS):
        g, s = divmod(i, 2)
        ids, mask = list(range(3, 3 + len(logp))), None
        if episodes:  # env tokens inserted before sampled token k: other ids, other (made up) numbers
            ids = ids[:k] + [99] * n + ids[k:]
            logp = logp[:k] + [None] * n + logp[k:]
            ref = ref[:k] + [-7.0] * n + ref[k:]
            values = values[:k] + [9.0] * n + values[k:]
            mask = [1] * k + [0] * n + [1] * (len(ids) - k - n)
        rollouts.append(rollout_row(g, s, [1, 2], ids, logp, mask=mask))
        scores.append(score_row(g, s, len(ids), reward))
        reference.append(reference_row(g, s, ref, values))
        where.append(np.array(mask or [1] * len(ids), dtype=bool))
    write_rows(root / "rollouts", ROLLOUTS, rollouts)
    write_rows(root / "scores", SCORES, scores)
    write_rows(root / "reference", REFERENCE, reference)
    return {"where": where, "dirs": {k: root / k for k in ("rollouts", "scores", "reference")}}


@pytest.mark.parametrize("estimator", [
    {"name": "gae", "gamma": 0.9, "lam": 0.8, "whiten": True},
    {"name": "reinforce_pp_baseline"},
    {"name": "grpo"},
])
def test_episode_advantages_equal_the_sampled_tokens_alone(tmp_path, estimator):
    out = {}
    for kind in ("single", "episode"):
        w = _write(tmp_path / kind, episodes=kind == "episode")
        manifest = run(AdvantageConfig(**w["dirs"], output=tmp_path / kind / "adv", estimator=estimator,
                                       kl={"in_reward": True, "beta": 0.3, "estimator": "k3"}))
        out[kind] = (pl.read_parquet(tmp_path / kind / "adv" / "part-*.parquet"), w["where"], manifest.extra)
    single, _, single_extra = out["single"]
    episode, where, episode_extra = out["episode"]
    for col in ("token_advantages", "returns", "values", "ref_logprobs", "kl"):
        if single[col].null_count() == len(single):
            continue
        for b, keep in enumerate(where):
            got = np.asarray(episode[col][b].to_list())
            np.testing.assert_array_equal(got[keep], np.asarray(single[col][b].to_list()), err_msg=col)
            assert (got[~keep] == 0).all(), col
    assert episode["advantage"].to_list() == single["advantage"].to_list()
    assert episode_extra == single_extra  # the summary counts sampled tokens only
