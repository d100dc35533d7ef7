"""The demo, shortened: the warm start is middling and GRPO raises reward and held-out accuracy."""

import pytest

from rlpipe.pipelines.preset import load_preset
from rlpipe.pipelines.report import eval_metrics
from rlpipe.pipelines.runner import Pipeline


@pytest.mark.integration
@pytest.mark.slow
def test_shortened_demo_reward_and_heldout_accuracy_rise(tmp_path, demo_setup):
    preset = load_preset("demo", ["iterations=12", "eval_every=0"])
    run_dir = demo_setup(tmp_path / "demo")  # (the demo's set-up, made once for the session)
    records = Pipeline(preset, run_dir, log=lambda s: None).run()

    before = eval_metrics(run_dir / "eval_0000")["accuracy"]
    after = eval_metrics(run_dir / "iter_0011" / "eval")["accuracy"]
    # Middling: SFT taught the answer's form (a model without it scores ~0) and left room. Where it
    # lands depends on the seed (0.50, 0.23, 0.36 for seeds 0-2, README) and, through the order of
    # floating-point sums, on the CPU's kernels: seed 0 gave 0.50 on an AVX-512 machine and 0.15
    # on an AVX2-only one (2026-11-27), from which GRPO still rose to 0.32 in these 12 iterations.
    assert 0.1 <= before <= 0.6, f"warm start should be middling, got {before}"
    assert after >= before + 0.1, f"held-out greedy accuracy {before:.2f} -> {after:.2f}"

    rewards = [r.metrics["reward_mean"] for r in records]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4, rewards
