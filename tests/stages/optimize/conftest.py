"""Synthetic rollouts + advantages artifacts for the optimisation stage (no other stage needed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest


def build_artifacts(root: Path, tokenizer, *, groups: int = 4, group_size: int = 4, seed: int = 0,
                    with_values: bool = False, with_ref: bool = False, iteration: int = 0,
                    environment: float | None = None) -> dict[str, Path]:
    """rollouts/ and advantages/ under `root`: responses of 2-7 random tokens; advantage +1 for even
    sample_index, -1 for odd (broadcast over tokens); reward = advantage. Positive responses draw
    their tokens from one half of the vocabulary and negative ones from the other, so a policy
    update can raise every positive response and lower every negative one.

    `environment` (episodes): 3 tokens an environment wrote are inserted after the first sampled
    one (response_mask 0 there), and every per-token number there (log-probs, advantages, returns,
    values, reference log-probs) is `environment` (0.0: the rollout log-probs null, as written)."""
    from rlpipe.schemas import ADVANTAGES, ROLLOUTS, write_table_artifact

    rng = np.random.default_rng(seed)
    vocab = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    ro: dict[str, list] = {c: [] for c in ROLLOUTS.column_names}
    adv: dict[str, list] = {c: [] for c in ADVANTAGES.column_names}
    for g in range(groups):
        prompt = f"Q: {g}+{g + 1}= A:"
        prompt_ids = tokenizer(prompt)["input_ids"]
        for s in range(group_size):
            n = int(rng.integers(2, 8))
            half = vocab[: len(vocab) // 2] if s % 2 == 0 else vocab[len(vocab) // 2:]
            resp = [int(x) for x in rng.choice(half, size=n)]
            a = 1.0 if s % 2 == 0 else -1.0
            logp = (-rng.random(n) * 5).tolist()
            ref = (-rng.random(n) * 5).tolist() if with_ref else [0.0] * n
            mask, tokens, values = None, [a] * n, [0.0] * n
            if environment is not None:
                e, k = environment, 1
                resp = resp[:k] + vocab[:3] + resp[k:]
                logp = logp[:k] + [e or None] * 3 + logp[k:]
                ref, tokens, values = (x[:k] + [e] * 3 + x[k:] for x in (ref, tokens, values))
                mask, n = [1] * k + [0] * 3 + [1] * (n - k), n + 3
            for k, v in dict(run="t", iteration=iteration, policy_version=0, prompt_id=f"p{g}", group_id=g,
                             sample_index=s, prompt=prompt, prompt_token_ids=prompt_ids, answer=None,
                             response=tokenizer.decode(resp), response_token_ids=resp,
                             response_logprobs=logp,
                             finish_reason="length" if len(resp) == 7 else "stop",
                             sampling=dict(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=7),
                             engine="transformers", seed=seed, metadata=None, response_mask=mask, num_turns=None,
                             turns=None, environment_reward=None).items():
                ro[k].append(v)
            for k, v in dict(run="t", iteration=iteration, prompt_id=f"p{g}", group_id=g, sample_index=s,
                             reward=a, advantage=a, token_advantages=tokens,
                             returns=tokens if with_values else None,
                             values=values if with_values else None,
                             ref_logprobs=ref if with_ref else None,
                             kl=None, estimator="synthetic", estimator_params=json.dumps({})).items():
                adv[k].append(v)
    out = {"rollouts": root / "rollouts", "advantages": root / "advantages"}
    write_table_artifact(out["rollouts"], ROLLOUTS, ro, stage="test", shard_by="group_id", rows_per_shard=8)
    # advantages in a different row order: the stage must join on the key, not rely on order
    order = list(reversed(range(len(adv["group_id"]))))
    write_table_artifact(out["advantages"], ADVANTAGES, {k: [v[i] for i in order] for k, v in adv.items()},
                         stage="test")
    return out


@pytest.fixture
def artifacts(tmp_path, tiny_tokenizer):
    return build_artifacts(tmp_path, tiny_tokenizer)



def optimize_config(root: Path, arts: dict[str, Path], policy: Path, name: str = "o", **overrides):
    from rlpipe.stages.optimize.config import OptimizeConfig

    base = dict(policy=policy, rollouts=arts["rollouts"], advantages=arts["advantages"],
                output=root / f"{name}_policy", metrics_output=root / f"{name}_metrics", lr=1e-3)
    return OptimizeConfig(**{**base, **overrides})


def metrics_of(path: Path) -> dict[int, dict[str, float]]:
    """{step: {name: value}} of a metrics artifact."""
    from rlpipe.schemas import read_table_artifact

    t = read_table_artifact(path, "metrics").to_pydict()
    out: dict[int, dict[str, float]] = {}
    for step, name, value in zip(t["step"], t["name"], t["value"], strict=True):
        out.setdefault(step, {})[name] = value
    return out


@pytest.fixture
def build():
    """build_artifacts(root, tokenizer, ...) (test modules cannot import conftest in importlib mode)."""
    return build_artifacts


@pytest.fixture
def make_config():
    return optimize_config


@pytest.fixture
def read_metrics():
    return metrics_of
