"""`rollouts`: G sampled responses per prompt, with everything later stages need.

Alignment: `response_token_ids` and `response_logprobs` have the same length T_i (the number of
generated tokens, EOS included when the response stopped on it). All samples of one group
(`group_id`) live in the same shard; rows are ordered by (group_id, sample_index) within a shard.
Written by `rlpipe.stages.rollout` (engines 'transformers' and 'vllm'); the stop strings and stop
token ids used are in the manifest's `config` (`stop`, `stop_token_ids`).

Greedy baseline rows: a rollout with `greedy_baseline: true` also writes, first in every group, the
greedy (temperature 0) response to the group's prompt, with `sample_index` = GREEDY_SAMPLE_INDEX
(-1) and temperature 0 in `sampling`. It is not a sample: the score stage scores it like any row,
the advantage stage uses its reward as the group's baseline (ReMax) and writes no advantage row for
it, so optimize, which trains on the advantages' rows, never trains on it.

Multi-turn episodes (rollout `environment`, version 3): `response_token_ids` holds every token of
the episode after the prompt, the model's turns and the environment's replies in order;
`response_mask` says who wrote each (1 the model, 0 the environment) and `response_logprobs` is
null where the environment wrote. `turns` lists the spans with their text, tool calls and results.
Every later stage trains, penalises and counts only the tokens with mask 1 (`sampled_lengths`). Single-turn rollouts
leave the episode columns null (every token sampled).
"""

from collections.abc import Sequence

import pyarrow as pa

from rlpipe.schemas.columns import LOGPROBS, TOKEN_IDS, ArtifactSchema, Column

#: temperature (0 = greedy), top_p (1 = off), top_k (0 = off), max_new_tokens.
SAMPLING = pa.struct(
    [
        pa.field("temperature", pa.float32()),
        pa.field("top_p", pa.float32()),
        pa.field("top_k", pa.int32()),
        pa.field("max_new_tokens", pa.int32()),
    ]
)

GREEDY_SAMPLE_INDEX = -1

#: One span of an episode (schemas/rollouts.py `turns`).
TURN = pa.struct([
    pa.field("role", pa.string()),  # 'model' or 'environment'
    pa.field("start", pa.int32()),  # first position in response_token_ids
    pa.field("end", pa.int32()),  # one past the last
    pa.field("text", pa.string()),
    pa.field("finish_reason", pa.string()),
    pa.field("tool_calls", pa.list_(pa.struct([pa.field("name", pa.string()), pa.field("arguments", pa.string()),
                                               pa.field("error", pa.string())]))),
    pa.field("tool_results", pa.list_(pa.struct([pa.field("name", pa.string()), pa.field("content", pa.string())]))),
    pa.field("reward", pa.float64()),
])

#: The columns the per-rollout artifacts (scores, reference, advantages) copy from rollouts: their
#: row key, and what they repeat, declared once so types and docs cannot drift apart.
AS_IN_ROLLOUTS = {c.name: c for c in (
    Column("run", pa.string(), "Run name, as in rollouts."),
    Column("iteration", pa.int32(), "Iteration, as in rollouts."),
    Column("prompt_id", pa.string(), "prompt_id, as in rollouts."),
    Column("group_id", pa.int64(), "group_id, as in rollouts."),
    Column("sample_index", pa.int32(), "sample_index, as in rollouts."),
    Column("finish_reason", pa.string(), "finish_reason, as in rollouts."),
)}
"""`sample_index` of a group's greedy baseline response (see the module docstring)."""

ROLLOUTS = ArtifactSchema(
    name="rollouts",
    version=3,
    doc="Sampled responses, G per prompt (a group), with behaviour-policy token log-probs.",
    columns=(
        Column("run", pa.string(), "Run name the rollouts belong to."),
        Column("iteration", pa.int32(), "Training iteration that produced the rollouts (0-based)."),
        Column(
            "policy_version",
            pa.int32(),
            "Number of optimisation rounds applied to the behaviour policy (0 = initial policy).",
        ),
        Column("prompt_id", pa.string(), "prompt_id of the prompt in the prompts artifact."),
        Column(
            "group_id",
            pa.int64(),
            "Index of the prompt within this iteration; the G samples of a prompt share it.",
        ),
        Column("sample_index", pa.int32(), "Index of the sample within its group, 0..G-1; -1 "
               "(GREEDY_SAMPLE_INDEX) for the group's greedy baseline response (rollout greedy_baseline)."),
        Column("prompt", pa.string(), "Prompt text as in the prompts artifact (before any chat template; "
               "prompt_token_ids are the tokens the policy saw)."),
        Column("prompt_token_ids", TOKEN_IDS, "Prompt token ids (BOS included if the tokenizer adds it; "
               "after the chat template when the rollout applied one)."),
        Column(
            "answer",
            pa.string(),
            "Reference answer copied from the prompts artifact, for verifiers; null if none.",
            nullable=True,
        ),
        Column(
            "response",
            pa.string(),
            "Decoded response text: special tokens skipped, cut before the stop string that ended it "
            "(vLLM may also hold back a trailing incomplete UTF-8 sequence).",
        ),
        Column(
            "response_token_ids",
            TOKEN_IDS,
            "Generated token ids, T_i of them; includes the token that ended the response (EOS, a "
            "stop token id, or the token that completed a stop string).",
        ),
        Column(
            "response_logprobs",
            LOGPROBS,
            "log pi_behaviour(token_t | prefix) of each generated token from raw logits "
            "(temperature 1, no top-p/top-k processing); same length as response_token_ids; null "
            "elements where the environment wrote the token (response_mask 0). nats.",
        ),
        Column("finish_reason", pa.string(), "'stop' (EOS, stop id or stop string) or 'length' (hit max_new_tokens; "
               "an episode: its last model turn did, or the context had no room for another turn)."),
        Column("sampling", SAMPLING, "Sampling parameters used for this response."),
        Column("engine", pa.string(), "Generation engine: 'transformers' or 'vllm'."),
        Column(
            "seed",
            pa.int64(),
            "Seed the group was sampled with: derived from (stage seed, iteration, group_id) by "
            "rlpipe.stages.rollout.core.group_seed, so it does not depend on batches, shards or workers.",
        ),
        Column(
            "metadata",
            pa.string(),
            "The prompt's metadata JSON object copied from the prompts artifact (test cases, choices, "
            "a reference solution, ...), for verifiers and user reward functions; null if none.",
            nullable=True,
            since=2,
        ),
        Column("response_mask", pa.list_(pa.int8()), "Episodes: who wrote each token of response_token_ids, "
               "1 the model (sampled, trained on), 0 the environment (inserted, never trained on); same "
               "length. Null: every token was sampled (a single-turn rollout).", nullable=True, since=3),
        Column("num_turns", pa.int32(), "Episodes: model turns taken. Null: a single-turn rollout.",
               nullable=True, since=3),
        Column("turns", pa.list_(TURN), "Episodes: the spans of response_token_ids in order, each "
               "{role ('model' | 'environment'), start, end (positions, end exclusive), text (a model "
               "turn's text; the environment's reply), finish_reason (model turns: 'stop', 'length', or "
               "'context' when no room was left for another turn), tool_calls ({name, arguments JSON, "
               "error} parsed from a model turn), tool_results ({name, content} of an environment "
               "turn), reward (the environment's, if it gave one)}. Null: a single-turn rollout. (The "
               "environment's timings are in the manifest's extra.timing.environment_*: shards stay reproducible.)", nullable=True, since=3),
        Column("environment_reward", pa.float64(), "Episodes: the sum of the rewards the environment "
               "gave (null if it gave none); the score stage's `environment` component reads it.",
               nullable=True, since=3),
    ),
    key=("iteration", "group_id", "sample_index"),
)


def response_masks(column: pa.ChunkedArray | pa.Array, lengths: Sequence[int], *, what: str) -> list[list[int]] | None:
    """The rollouts' `response_mask` rows (1 where the model sampled the token, 0 where an
    environment wrote it); a null row (a single-turn response) is all ones. None when every row is
    null. Raises, naming `what` and the row, when a row's length is not the response's."""
    if column.null_count == len(column):
        return None
    rows = [[1] * int(n) if m is None else m for m, n in zip(column.to_pylist(), lengths, strict=True)]
    bad = [b for b, (m, n) in enumerate(zip(rows, lengths, strict=True)) if len(m) != n]
    if bad:
        raise ValueError(f"{what}: row {bad[0]} has {len(rows[bad[0]])} mask values, expected {lengths[bad[0]]} "
                         "(the response length)")
    return rows


def sampled_lengths(column: pa.ChunkedArray | pa.Array, lengths: Sequence[int], *, what: str) -> list[int]:
    """How many tokens the model sampled in each row: the ones of its `response_mask` (an
    episode's model turns), or every one of its `lengths` response tokens (a null mask: a
    single-turn response). The one definition of a response's length wherever one is counted
    (score's `sampled_tokens`, the report's and evaluate's lengths, rollout's generated tokens
    and tokens/s, optimize's `max_len`): the environment's tokens are read, never counted."""
    rows = response_masks(column, lengths, what=what)
    return [int(n) for n in lengths] if rows is None else [sum(m) for m in rows]
