"""`advantages`: what the optimiser consumes, besides the rollout tokens.

Alignment: every list column has the same length as the rollout's `response_token_ids`.
Shards: one per scores shard, same index and row order (so a group stays in one shard).
Sequence estimators (grpo, dr_grpo, rloo) fill `advantage` and broadcast it into
`token_advantages`; reinforce_pp_baseline fills `token_advantages` only (whitened per token);
gae fills `token_advantages`, `returns` and `values`.
With the KL in the reward (`estimator_params.kl_in_reward`), gae sees token rewards
`-beta * kl_t` plus R on the last token, and sequence estimators see `R - beta * sum_t kl_t`;
the `reward` column keeps R unpenalised. The manifest's `extra` holds the batch summary
(groups, zero_variance_groups, reward and advantage moments, KL means, kl_beta_next).
Episodes (rollouts with a `response_mask`): every list column is 0 on the tokens the environment
wrote; the estimators, KL and the summary see only the sampled tokens, in order (read with the
rollouts, `rollouts=`).
"""

import pyarrow as pa

from rlpipe.schemas.columns import LOGPROBS, ArtifactSchema, Column
from rlpipe.schemas.rollouts import AS_IN_ROLLOUTS, ROLLOUTS

ADVANTAGES = ArtifactSchema(
    name="advantages",
    version=1,
    doc="Advantages (and returns, values, reference log-probs, KL) per rollout; same keys as rollouts.",
    columns=(
        *(AS_IN_ROLLOUTS[c] for c in ("run", "iteration", "prompt_id", "group_id", "sample_index")),
        Column("reward", pa.float32(), "Sequence reward R from the scores artifact (before any KL penalty)."),
        Column(
            "advantage",
            pa.float32(),
            "Sequence-level advantage A_i (grpo, dr_grpo, rloo); null for token-level estimators "
            "(reinforce_pp_baseline, gae).",
            nullable=True,
        ),
        Column("token_advantages", LOGPROBS, "Per-token advantage A_t used by the policy loss."),
        Column("returns", LOGPROBS, "Per-token return R_t = A_t + V_t (gae); null otherwise.", nullable=True),
        Column(
            "values",
            LOGPROBS,
            "Per-token critic values V_t, copied from the reference artifact when it has them (gae "
            "needs them); null otherwise.",
            nullable=True,
        ),
        Column(
            "ref_logprobs",
            LOGPROBS,
            "Per-token reference log-probs, when a reference model is used; null otherwise.",
            nullable=True,
        ),
        Column(
            "kl",
            LOGPROBS,
            "Per-token KL estimate of the behaviour policy (rollout log-probs) against the reference "
            "(estimator in `estimator_params.kl_estimator`); null without reference log-probs.",
            nullable=True,
        ),
        Column("estimator", pa.string(), "Advantage estimator name (registry key), e.g. 'grpo'."),
        Column(
            "estimator_params",
            pa.string(),
            "JSON object of the estimator's parameters (its knobs, e.g. std/scale/eps or "
            "gamma/lam/whiten/eps) plus kl_estimator, kl_in_reward and kl_beta.",
        ),
    ),
    key=ROLLOUTS.key,
)
