"""The demo with TRPO (preset demo_trpo), shortened: held-out accuracy rises, and every iteration's
step is accepted inside the KL bound."""

import pytest

from rlpipe.pipelines.preset import load_preset
from rlpipe.pipelines.report import eval_metrics
from rlpipe.pipelines.runner import Pipeline
from rlpipe.schemas import read_table_artifact


@pytest.mark.integration
@pytest.mark.slow
def test_shortened_trpo_demo_heldout_accuracy_rises(tmp_path, demo_setup):
    iterations = 8
    preset = load_preset("demo_trpo", [f"iterations={iterations}", "eval_every=0"])
    max_kl = preset.optimize["loss"]["max_kl"]
    run_dir = demo_setup(tmp_path / "demo")  # (the demo's set-up, made once for the session)
    Pipeline(preset, run_dir, log=lambda s: None).run()

    before = eval_metrics(run_dir / "eval_0000")["accuracy"]
    after = eval_metrics(run_dir / f"iter_{iterations - 1:04d}" / "eval")["accuracy"]
    # TRPO's every step is bounded by max_kl, so from a weak warm start 8 iterations move little:
    # seed 0's warm start depends on the CPU's kernels (0.50 on an AVX-512 machine, where this
    # rose by 0.1 or more; 0.15 on an AVX2-only one, where it rose to 0.20, and to 0.24 in 12
    # iterations; 2026-11-27). The claim is the direction; the trust region is checked below.
    assert after > before, f"held-out greedy accuracy {before:.2f} -> {after:.2f}"
    for it in range(iterations):
        t = read_table_artifact(run_dir / f"iter_{it:04d}" / "metrics", "metrics").to_pydict()
        m = {n: v for s, n, v in zip(t["step"], t["name"], t["value"], strict=True) if s == 1}
        # an accepted step inside the trust region, or no step at all (then its KL is 0)
        assert 0.0 <= m["trpo_kl"] <= max_kl, (it, m)
        assert m["trpo_accepted"] == 0.0 or m["trpo_loss_improvement"] > 0.0, (it, m)
