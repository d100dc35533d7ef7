"""TRPO: the pure math against closed forms, and the optimize stage's TRPO step on DeepSpeed.

The closed-form problem: a softmax policy over K actions in S states with logits theta[s] (the
parameters themselves). The Fisher of KL(pi_old || pi_theta) averaged over the states is block
diagonal with blocks (diag p_s - p_s p_s^T) / S, so the exact natural-gradient step is a
torch.linalg.solve away.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from rlpipe.stages.optimize.config import OptimizeConfig, TRPOLoss
from rlpipe.stages.optimize.trpo import (
    categorical_kl,
    conjugate_gradient,
    fisher_vector_product,
    flat_grad,
    kl_gradients,
    line_search,
    max_step,
)

S, K = 3, 5
DAMPING = 0.1
DELTA = 0.01


def _problem(seed: int = 0):
    """theta (S, K) in float64, sampled actions with advantages, the surrogate loss function."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(S, K, generator=g, dtype=torch.float64)
    actions = torch.randint(0, K, (S, 4), generator=g)
    advantages = torch.randn(S, 4, generator=g, dtype=torch.float64)
    old = torch.log_softmax(theta, -1).detach()

    def loss(t: torch.Tensor) -> torch.Tensor:
        # L = -mean_{s,i} rho A, rho = pi_t(a) / pi_old(a)
        logp = torch.log_softmax(t, -1)
        rho = torch.exp(logp.gather(1, actions) - old.gather(1, actions))
        return -(rho * advantages).mean()

    def mean_kl(t: torch.Tensor) -> torch.Tensor:
        return categorical_kl(old, torch.log_softmax(t, -1)).mean()

    return theta, loss, mean_kl


def _exact_fisher(theta: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(theta, -1)
    return torch.block_diag(*[(torch.diag(ps) - torch.outer(ps, ps)) / S for ps in p])


def _fvp(theta: torch.Tensor, damping: float = DAMPING):
    logp = torch.log_softmax(theta, -1)
    grads = kl_gradients([categorical_kl(logp.detach(), logp).mean()], [theta])

    def fvp(v: torch.Tensor) -> torch.Tensor:
        return fisher_vector_product(grads, [theta], v, damping=damping)
    return fvp


def test_fisher_vector_product_is_the_closed_form_fisher():
    theta, _, _ = _problem()
    theta.requires_grad_(True)
    A = _exact_fisher(theta.detach()) + DAMPING * torch.eye(S * K, dtype=torch.float64)
    v = torch.randn(S * K, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    # float64 autograd of the same expression: agreement to a few ulps of |F v|
    torch.testing.assert_close(_fvp(theta)(v), A @ v, rtol=1e-12, atol=1e-14)


def test_conjugate_gradient_step_is_the_exact_natural_gradient_step():
    theta, loss, _ = _problem()
    theta.requires_grad_(True)
    g = flat_grad(loss(theta), [theta]).double()
    A = _exact_fisher(theta.detach()) + DAMPING * torch.eye(S * K, dtype=torch.float64)
    exact = torch.linalg.solve(A, -g)
    fvp = _fvp(theta)
    # CG's error in the A-norm after k iterations is at most 2 ((sqrt c - 1) / (sqrt c + 1))^k of the
    # initial one (x_0 = 0, so ||x*||_A), c = cond(A); checked for each k, with 1e-9 of room for rounding.
    eig = torch.linalg.eigvalsh(A)
    c = float(eig.max() / eig.min())
    q = (math.sqrt(c) - 1) / (math.sqrt(c) + 1)

    def a_norm(x):
        return float(torch.sqrt(x @ A @ x))

    for k in range(1, 8):
        x, _ = conjugate_gradient(fvp, -g, iters=k, residual_tol=0.0)
        assert a_norm(x - exact) <= 2 * q ** k * a_norm(exact) + 1e-9, k
    # In exact arithmetic CG ends after as many iterations as A has distinct eigenvalues (<= S*K):
    # with S*K iterations the float64 solve is exact up to cond(A) * eps.
    x, _ = conjugate_gradient(fvp, -g, iters=S * K, residual_tol=0.0)
    torch.testing.assert_close(x, exact, rtol=c * 1e-13, atol=c * 1e-13 * float(exact.abs().max()))
    # and the scaled step: sqrt(2 delta / x^T A x) x
    step = max_step(x, fvp(x), DELTA)
    expected = math.sqrt(2 * DELTA / float(exact @ A @ exact)) * exact
    torch.testing.assert_close(step, expected, rtol=c * 1e-12, atol=1e-12)


def _trpo_update(theta: torch.Tensor, loss, mean_kl, *, max_kl: float, steps: int = 10, scale: float = 1.0):
    """One TRPO update of the closed-form problem: (new theta or None, line-search result)."""
    t = theta.detach().clone().requires_grad_(True)
    g = flat_grad(loss(t), [t]).double()
    x, _ = conjugate_gradient(_fvp(t), -g, iters=10)
    s = scale * max_step(x, _fvp(t)(x), max_kl)

    def evaluate(f: float) -> tuple[float, float]:
        trial = (theta.reshape(-1) + f * s).reshape(theta.shape)
        with torch.no_grad():
            return float(loss(trial)), float(mean_kl(trial))

    with torch.no_grad():
        result = line_search(evaluate, float(loss(theta)), max_kl=max_kl, backtrack_ratio=0.5, steps=steps)
    new = None if result.fraction is None else (theta.reshape(-1) + result.fraction * s).reshape(theta.shape)
    return new, result


def test_every_update_keeps_the_kl_bound_and_improves_the_surrogate():
    for seed in range(5):
        theta, loss, _ = _problem(seed)
        for _ in range(4):  # successive updates, each constrained w.r.t. the policy it starts from
            old = torch.log_softmax(theta, -1).detach()
            new, result = _trpo_update(theta, loss, lambda t, o=old: categorical_kl(o, torch.log_softmax(t, -1)).mean(),
                                       max_kl=DELTA)
            assert new is not None, result.trials
            measured = float(categorical_kl(old, torch.log_softmax(new, -1)).mean())
            assert measured <= DELTA
            assert measured == pytest.approx(result.kl, rel=1e-12)
            assert float(loss(new)) < float(loss(theta))
            theta = new


def test_line_search_backtracks_past_a_step_that_breaks_the_bound():
    theta, loss, mean_kl = _problem()
    # a full step 20x the trust region's: the quadratic model says KL ~ 400 delta at fraction 1
    new, result = _trpo_update(theta, loss, mean_kl, max_kl=DELTA, scale=20.0)
    assert result.trials[0][2] > DELTA  # the full step was tried and refused
    assert result.fraction is not None and result.fraction < 1.0
    assert all(kl > DELTA or trial_loss >= float(loss(theta)) for _, trial_loss, kl in result.trials[:-1])
    assert float(mean_kl(new)) <= DELTA


def test_line_search_rejects_every_step_that_breaks_the_bound():
    theta, loss, mean_kl = _problem()
    # three tries only (fractions 1, 1/2, 1/4) of a 100x step: every one breaks the bound
    new, result = _trpo_update(theta, loss, mean_kl, max_kl=DELTA, scale=100.0, steps=3)
    assert new is None and result.fraction is None and result.kl == 0.0
    assert [f for f, _, _ in result.trials] == [1.0, 0.5, 0.25]
    assert all(kl > DELTA for _, _, kl in result.trials)


def test_line_search_rejects_a_step_that_does_not_improve():
    calls = []

    def evaluate(f):
        calls.append(f)
        return 1.0 + f, 0.0  # KL fine, loss worse at every fraction

    result = line_search(evaluate, 1.0, max_kl=DELTA, backtrack_ratio=0.8, steps=4)
    assert result.fraction is None and result.loss == 1.0
    assert calls == pytest.approx([1.0, 0.8, 0.64, 0.512])


def test_config_refuses_zero_2_and_3(tmp_path):
    base = dict(policy=tmp_path / "p", rollouts=tmp_path / "r", advantages=tmp_path / "a", output=tmp_path / "o",
                metrics_output=tmp_path / "m", loss={"name": "trpo", "max_kl": 0.02})
    assert OptimizeConfig(**base, zero_stage=1).loss == TRPOLoss(max_kl=0.02)
    for z in (2, 3):
        with pytest.raises(ValueError, match="trpo needs zero_stage 0 or 1"):
            OptimizeConfig(**base, zero_stage=z)


# ---------------------------------------------------------------------------------------------
# The stage on DeepSpeed
# ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TRPO = {"name": "trpo", "max_kl": 0.01, "cg_iters": 10, "cg_damping": 0.1}


@pytest.mark.integration
@pytest.mark.slow
def test_two_ranks_equal_one_rank_under_zero_0_and_1(tmp_path, artifacts, tiny_policy_dir, make_config, read_metrics):
    from rlpipe.cluster.launch import local_env, stage_command, torchrun_executable
    from rlpipe.stages.optimize.run import run

    # 16 rows, minibatch 8: two TRPO steps; 2 ranks x 4 rows (2 micro-batches of 2) vs 1 rank x 8
    common = dict(minibatch_size=8, epochs=1, loss=TRPO)
    configs = {}
    for z in (0, 1):
        configs[(z, 1)] = make_config(tmp_path, artifacts, tiny_policy_dir, f"z{z}_1", zero_stage=z, micro_batch_size=8, **common)
        configs[(z, 2)] = make_config(tmp_path, artifacts, tiny_policy_dir, f"z{z}_2", zero_stage=z, micro_batch_size=2, **common)
    yamls = []
    for z in (0, 1):
        path = tmp_path / f"z{z}_2.yaml"
        path.write_text(yaml.safe_dump(configs[(z, 2)].resolved()))
        yamls.append(str(path))
    driver = Path(__file__).with_name("torchrun_driver.py")
    cmd = stage_command("optimize", nproc_per_node=2, master_port=_free_port())
    cmd = [torchrun_executable(), *cmd[1:cmd.index("-m")], str(driver), *yamls]
    env = local_env(threads_per_rank=1)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), os.getcwd()]))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for z in (0, 1):
        run(configs[(z, 1)])
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]

    start = load_file(Path(tiny_policy_dir) / "model.safetensors")
    for z in (0, 1):
        one = load_file(configs[(z, 1)].output / "model.safetensors")
        two = load_file(configs[(z, 2)].output / "model.safetensors")
        assert any(not torch.equal(one[k], start[k]) for k in one), f"ZeRO {z}: TRPO did not move the policy"
        for k in one:
            # fp32 sums in another order (micro-batches, all-reduce) through CG: ~1e-7 relative
            # differences in g and F v, amplified by at most cond(F + damping I) ~ 1e2 in the step.
            assert (one[k] - two[k]).abs().max().item() <= 1e-5, (z, k)
        m1, m2 = read_metrics(configs[(z, 1)].metrics_output), read_metrics(configs[(z, 2)].metrics_output)
        for step in (1, 2):
            assert m1[step]["trpo_accepted"] == m2[step]["trpo_accepted"] == 1.0
            assert m1[step]["trpo_step_fraction"] == m2[step]["trpo_step_fraction"]
            assert 0.0 < m1[step]["trpo_kl"] <= TRPO["max_kl"]
            for name in ("trpo_kl", "grad_norm", "loss", "trpo_loss_improvement"):
                assert m2[step][name] == pytest.approx(m1[step][name], rel=1e-4, abs=1e-7), (z, step, name)
    # ZeRO 1 keeps its masters in partitions: the same update as ZeRO 0's
    z0, z1 = (load_file(configs[(z, 1)].output / "model.safetensors") for z in (0, 1))
    assert max((z0[k] - z1[k]).abs().max().item() for k in z0) <= 1e-5


@pytest.mark.integration
@pytest.mark.slow
def test_bf16_step_goes_to_the_fp32_masters(tmp_path, artifacts, tiny_policy_dir, make_config, read_metrics):
    """In bf16 the step is written to the engine's fp32 masters (ZeRO 0: the unfused optimizer's
    fp32 copies; ZeRO 1: this rank's flat partition), and the module holds them rounded."""
    from rlpipe.stages.optimize.run import clear_warm, run
    from rlpipe.stages.optimize.state import master_weights

    start = {k: v.bfloat16().float() for k, v in load_file(Path(tiny_policy_dir) / "model.safetensors").items()}
    masters = {}
    for z in (0, 1):
        cfg = make_config(tmp_path, artifacts, tiny_policy_dir, f"bf{z}", zero_stage=z, dtype="bf16", micro_batch_size=16,
                          loss=TRPO, train_state_output=tmp_path / f"bf{z}_state")
        run(cfg)
        clear_warm()
        assert read_metrics(cfg.metrics_output)[1]["trpo_accepted"] == 1.0
        masters[z] = {k: v.float() for k, v in master_weights(cfg.train_state_output).items()}
        saved = load_file(cfg.output / "model.safetensors")
        names = [k for k in saved if k in masters[z]]
        assert len(names) == len(saved)
        for k in names:
            # the module (and checkpoint) is the masters rounded to bf16
            assert torch.equal(saved[k].float(), masters[z][k].bfloat16().float()), (z, k)
        delta = torch.cat([(masters[z][k] - start[k]).flatten() for k in names])
        assert delta.abs().max() > 0
        # fp32 masters: most moved values are no bf16 number (a master copied back from the bf16
        # module would be one, and a step below a weight's bf16 spacing would be lost)
        moved = torch.cat([masters[z][k].flatten() for k in names])[delta != 0]
        assert (moved != moved.bfloat16().float()).float().mean() > 0.9, z
    # the same step whether the masters are whole (ZeRO 0) or partitioned (ZeRO 1): the same bf16
    # forward passes and fp32 CG, so the same numbers
    for k in masters[0]:
        assert torch.allclose(masters[0][k], masters[1][k], rtol=0, atol=1e-6), k
