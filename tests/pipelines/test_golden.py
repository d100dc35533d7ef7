"""Golden regression of a whole tiny GRPO run: the sampled tokens, the rewards and the optimize
stage's per-step metrics of three iterations, against numbers recorded from the code as it was
when this test was written (fp32 on CPU, one torch thread, seed 0).

Any change to sampling, scoring, advantages, the loss, its aggregation, gradient clipping or the
optimizer shows up here as a changed number. When a change is intended, rerun the pipeline below,
check that the new numbers make sense, and replace the goldens in the same commit.
"""

from __future__ import annotations

import hashlib
import json

import yaml

from rlpipe.pipelines.preset import load_preset
from rlpipe.pipelines.runner import Pipeline
from rlpipe.schemas import METRICS, ROLLOUTS, SCORES, read_table_artifact

# Spelled out (not conftest.MINI) so that editing the shared mini preset cannot move the goldens.
# 5 SFT steps leave the micro model near its random init: it almost never answers correctly, so a
# format reward (the first response character is printable ASCII, ~37% of byte tokens) gives the
# groups reward variance and every optimizer step a non-zero gradient. A reference model with
# kl_beta > 0 puts the KL term in the loss; minibatch 8 of 16 rows gives two steps per iteration,
# the second one off-policy (approx_kl > 0, ratio != 1).
PRESET = {
    "name": "golden",
    "seed": 0,
    "iterations": 3,
    "prompts_per_iteration": 4,
    "eval_every": 3,
    "data": {"task": {"kind": "arithmetic", "a_range": [0, 9], "b_range": [0, 9], "ops": ["+"],
                      "n_train": 40, "n_heldout": 10}},
    "base_model": {"size": "micro"},
    "model": {"reference": True},
    "sft": {"max_steps": 5, "batch_size": 16, "lr": 3.0e-3},
    "rollout": {"group_size": 4, "max_new_tokens": 3},
    "score": {"components": [
        {"name": "correct", "type": "answer_match", "mode": "exact"},
        {"name": "printable", "type": "regex_format", "pattern": "^[ -~]", "weight": 0.5},
    ]},
    "advantage": {"estimator": "grpo"},
    "optimize": {"lr": 1.0e-3, "micro_batch_size": 8, "minibatch_size": 8, "kl_beta": 0.04},
    "evaluate": {"max_new_tokens": 3},
}

# sha256 of the JSON list of response token ids, rows ordered by (group_id, sample_index), and the
# mean reward, per iteration. Token ids are discrete: they must match exactly. The same ids came
# out with ATen's vector kernels forced to the scalar path (ATEN_CPU_CAPABILITY=default) and MKL /
# oneDNN restricted to SSE4 (MKL_ENABLE_INSTRUCTIONS=SSE4_2, MKL_CBWR=COMPATIBLE,
# DNNL_MAX_CPU_ISA=SSE41), which change the logits by ~1 ulp: a draw would have to land within
# ~1e-7 of a CDF boundary to flip. (The rollouts' content hash is NOT a golden: it covers the
# engine's float log-probs, which do change by an ulp under those settings.)
ROLLOUT_GOLDEN = {
    0: ("1b3aa8ea572434fb", 0.15625),
    1: ("6195450e38a3d2e2", 0.25),
    2: ("f5184390bcc8726b", 0.09375),
}

# iteration -> [step 1, step 2] of the optimize stage's metrics.
OPTIMIZE_GOLDEN = {
    0: [{"policy_loss": 0.17075252532958984, "loss": 0.17075252532958984, "grad_norm": 1.2171432971954346, "approx_kl": 0.0, "kl_ref": 0.0},
        {"policy_loss": -0.1714753657579422, "loss": -0.17144519090652466, "grad_norm": 1.1475297212600708, "approx_kl": 0.0007145727868191898, "kl_ref": 0.0007544730906374753}],
    1: [{"policy_loss": -0.3415050804615021, "loss": -0.3414517641067505, "grad_norm": 1.0638642311096191, "approx_kl": 0.0, "kl_ref": 0.0013328567147254944},
        {"policy_loss": 0.3354034125804901, "loss": 0.3354601562023163, "grad_norm": 1.2090048789978027, "approx_kl": 0.000489587604533881, "kl_ref": 0.0014188835630193353}],
    2: [{"policy_loss": 0.12499949336051941, "loss": 0.12509070336818695, "grad_norm": 0.9530582427978516, "approx_kl": 0.0, "kl_ref": 0.002280188025906682},
        {"policy_loss": -0.12353137880563736, "loss": -0.1234142929315567, "grad_norm": 1.3239941596984863, "approx_kl": 0.00028855600976385176, "kl_ref": 0.002927057445049286}],
}

# Tolerance: |got - golden| <= RTOL * |golden| + ATOL. Run to run on one machine the numbers are
# bit-identical (fp32, one thread, deterministic kernels, seeded sampling); what moves between
# machines is the kernels' summation order (AVX2 vs AVX-512 vs scalar ATen reductions, MKL/oneDNN
# GEMM blocking), i.e. ~1 ulp per log-prob. With the kernel settings above the metrics moved by:
# - loss, policy_loss, grad_norm: <= 1e-6 relative. loss = -token-mean(A * rho) with |A| <~ 1.5
#   and rho = exp(logp - old_logp): a few ulp(|logp| ~ 5.5) = ~2e-6 in (logp - old_logp) moves
#   it by <~ 3e-6 absolute, ~1e-5 relative at |loss| >= 0.12: RTOL = 1e-5.
# - approx_kl, kl_ref: up to 2.5e-5 RELATIVE (3e-8 absolute): k3(d) ~ d^2 / 2 of a difference d
#   of two log-probs of ~5.5, so delta k3 ~ |d| * delta d <~ 0.1 * 2e-6 = 2e-7: ATOL = 2e-7, which
#   is also far below every non-zero KL golden (>= 2.9e-4) and keeps the step-1 zeros meaningful.
RTOL, ATOL = 1e-5, 2e-7


def _tokens_digest(path) -> str:
    rows = read_table_artifact(path, ROLLOUTS, columns=["group_id", "sample_index", "response_token_ids"]).to_pylist()
    rows.sort(key=lambda r: (r["group_id"], r["sample_index"]))
    return hashlib.sha256(json.dumps([r["response_token_ids"] for r in rows]).encode()).hexdigest()[:16]


def _optimize_steps(path) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for r in read_table_artifact(path, METRICS).to_pylist():
        if r["stage"] == "optimize" and r["step"] > 0:
            out.setdefault(r["step"], {})[r["name"]] = r["value"]
    return out


# Not `integration`: ~3 s inside the suite (alone, 25-35 s on 2 busy cores, nearly all of it the
# torch/DeepSpeed imports and DeepSpeed's one-off op build that the suite's other tests share), and
# the refactors it guards are checked by `make test-fast` too.
def test_tiny_grpo_run_matches_the_golden_numbers(tmp_path):
    preset_file = tmp_path / "golden.yaml"
    preset_file.write_text(yaml.safe_dump(PRESET))
    run_dir = tmp_path / "runs" / "golden"
    Pipeline(load_preset(preset_file), run_dir, log=lambda s: None).run()

    for k, (digest, reward_mean) in ROLLOUT_GOLDEN.items():
        it = run_dir / f"iter_{k:04d}"
        assert _tokens_digest(it / "rollouts") == digest, f"iteration {k}: the sampled tokens changed"
        rewards = read_table_artifact(it / "scores", SCORES, columns=["reward"]).column("reward").to_pylist()
        assert sum(rewards) / len(rewards) == reward_mean, f"iteration {k}: the rewards changed"

    for k, golden_steps in OPTIMIZE_GOLDEN.items():
        steps = _optimize_steps(run_dir / f"iter_{k:04d}" / "metrics")
        assert sorted(steps) == [1, 2], f"iteration {k}: optimizer steps {sorted(steps)}"
        for step, golden in enumerate(golden_steps, start=1):
            for name, want in golden.items():
                got = steps[step][name]
                assert abs(got - want) <= RTOL * abs(want) + ATOL, (
                    f"iteration {k} step {step} {name}: {got!r} != golden {want!r}")
