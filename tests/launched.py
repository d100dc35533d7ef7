"""The LAUNCHED preset every launcher's run is compared with the in-process run on, and the
comparison (tests/cluster; imported by name, as `conftest` is the top-level one)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from conftest import KEEP_EVERYTHING, MINI

#: MINI with rollouts in 2 shards, a reference model (so the reference stage runs), micro-batches of 8 (so 2 ranks each
#: get one of the 16 rows' minibatch), and a format reward that varies within groups (MINI's
#: exact-match reward is 0 everywhere after 5 SFT steps, and zero advantages would leave the
#: policy where it started: a policy comparison that could not fail).
LAUNCHED = {
    **MINI,
    "eval_every": 0,
    "rollout": {**MINI["rollout"], "groups_per_shard": 2},  # 2 shards: each of 2 workers writes one
    "model": {"reference": True},
    "optimize": {**MINI["optimize"], "micro_batch_size": 8},
    "score": {"components": [*MINI["score"]["components"],
                             {"name": "alnum", "type": "regex_format", "pattern": "[0-9A-Za-z]"}]},
    "keep": KEEP_EVERYTHING,  # every iteration's policy is compared
}

#: Rollout and reference on 2 worker processes each, optimize on 2 torchrun ranks.
PLACEMENT = {"rollout": {"workers": 2}, "reference": {"workers": 2},
             "optimize": {"nodes": 1, "ranks_per_node": 2}}

DETERMINISTIC = ("rollouts", "scores", "reference", "advantages")


def write_preset(path: Path, launch: dict | None = None) -> Path:
    path.write_text(yaml.safe_dump({**LAUNCHED, **({"launch": launch} if launch else {})}))
    return path


def _content_hashes(run_dir: Path, iteration: str) -> dict[str, str]:
    return {name: json.loads((run_dir / iteration / name / "_manifest.json").read_text())["content_hash"]
            for name in DETERMINISTIC}


def _max_difference(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    pa, pb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert pa.keys() == pb.keys()
    return max((pa[k] - pb[k]).abs().max().item() for k in pa)


def assert_like_reference(run_dir: Path, reference: Path) -> None:
    """Every iteration of `run_dir` has the rollouts, scores, reference and advantages of
    `reference`'s (content hashes) and a policy within 1e-5 of its policy (which moved: the
    comparison can fail)."""
    iterations = sorted(p.name for p in run_dir.glob("iter_*"))
    assert iterations, f"{run_dir} holds no iteration"
    start = reference / "models" / "sft"
    for k in iterations:
        # Iteration k >= 1 samples from a policy that differs from the reference's by float32
        # rounding (below): a sample changes only where a uniform draw falls within ~1e-7 of a
        # CDF boundary, which the few hundred draws of this run never come near.
        assert _content_hashes(run_dir, k) == _content_hashes(reference, k), k
        # 2 ranks sum the same per-token gradients in another order (gloo all-reduce), so
        # parameters differ by float32 rounding after Adam steps of lr 1e-3: ~1e-7, bound 1e-5
        # (the rank-invariance test in tests/stages/optimize uses the same bound).
        assert _max_difference(reference / k / "policy", start) > 1e-4, f"{k}: the policy did not move"
        if json.loads((run_dir / k / "policy" / "_manifest.json").read_text()).get("not_written"):
            continue  # (weights held in memory only: the next iteration's rollouts, compared above, sampled from them)
        assert _max_difference(run_dir / k / "policy", reference / k / "policy") <= 1e-5, k
