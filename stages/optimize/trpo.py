"""TRPO's math as small pure functions: flat gradients, Fisher-vector products, conjugate gradient,
the backtracking line search (Schulman et al. 2015, https://arxiv.org/abs/1502.05477, appendix C).

No DeepSpeed, no process groups: a cross-rank sum is passed in as `all_reduce` (identity on one
rank). trpo_step.py drives them on the optimize stage's engines.

The problem of one step, theta the flat parameters, L(theta) the loss (minus the surrogate
sum_t rho_t A_t, aggregated as configured), KLbar the mean over response tokens of
KL(pi_old(. | s_t) || pi_theta(. | s_t)) over the whole vocabulary:

    minimise  L(theta_old + s)   subject to   KLbar(theta_old + s) <= delta

Linearising L (gradient g = grad L) and taking the KL to second order (its Hessian at theta_old is
the Fisher F, its gradient there is 0) gives the natural-gradient direction x = -F^-1 g and the
largest step along it inside the quadratic trust region:

    s = sqrt(2 delta / (x^T F x)) * x

then the line search shrinks s until the real L improves and the real KLbar <= delta.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

Reduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def flat_grad(y: torch.Tensor, params: Sequence[torch.Tensor], *, create_graph: bool = False,
              retain_graph: bool | None = None) -> torch.Tensor:
    """grad_theta y as one vector over `params` (in order; zeros for parameters y does not use), in
    fp32 at least (a bf16 model's gradients are promoted, float64 stays float64).

    Uses torch.autograd.grad, never .backward: the parameters' .grad (DeepSpeed's buffers) stay
    untouched. With create_graph the result is differentiable again (for a Fisher-vector product);
    retain_graph keeps y's graph for another call.
    """
    grads = torch.autograd.grad(y, list(params), create_graph=create_graph, retain_graph=retain_graph,
                                allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).to(torch.promote_types(p.dtype, torch.float32))
                      for g, p in zip(grads, params, strict=True)])


def kl_gradients(kl_terms: Iterable[torch.Tensor], params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """grad_theta of each micro-batch's share of KLbar, with its graph (for fisher_vector_product).

    `kl_terms` yields each micro-batch's share of KLbar (already divided by the global token count,
    so the shares of every micro-batch on every rank sum to KLbar), each computed with pi_old
    detached at the current parameters: value 0, gradient 0, and Hessian the Fisher information
    of the token distributions, F = E_t[J_t^T (diag p - p p^T) J_t] (J_t = d logits_t / d theta).
    Computed once per step and reused by every conjugate-gradient iteration.
    """
    return [flat_grad(kl, params, create_graph=True) for kl in kl_terms]


def fisher_vector_product(kl_grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor], v: torch.Tensor, *,
                          damping: float, all_reduce: Reduce = _identity) -> torch.Tensor:
    """(F + damping I) v by double backward of the mean KL, summed over micro-batches and ranks.

        F v = grad_theta ( (grad_theta KLbar)^T v )        (Pearlmutter's trick, exact at theta_old)

    `kl_grads` are `kl_gradients(...)` (one per micro-batch, graphs kept). The damping is added
    once, after the cross-rank sum.

    Shape:
        v (P,) -> (P,), P the number of parameters.
    """
    out = torch.zeros_like(v)
    for g in kl_grads:
        out += flat_grad(g @ v.to(g.dtype), params, retain_graph=True)
    return all_reduce(out) + damping * v


def conjugate_gradient(fvp: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, *, iters: int,
                       residual_tol: float = 1e-10) -> tuple[torch.Tensor, int]:
    """Solve A x = b for a symmetric positive-definite A given only x -> A x (Hestenes-Stiefel).

        r_0 = p_0 = b, x_0 = 0
        alpha_k = r_k^T r_k / p_k^T A p_k
        x_{k+1} = x_k + alpha_k p_k,        r_{k+1} = r_k - alpha_k A p_k
        p_{k+1} = r_{k+1} + (r_{k+1}^T r_{k+1} / r_k^T r_k) p_k

    Stops after `iters` products or once r^T r < residual_tol. In exact arithmetic it solves an
    n x n system in n iterations; the error after k shrinks as 2 ((sqrt(c) - 1) / (sqrt(c) + 1))^k
    in the A-norm, c = cond(A).

    Returns:
        (x, iterations done). Shape: b (P,) -> x (P,).
    """
    x = torch.zeros_like(b)
    r = b.clone()
    p = b.clone()
    rr = r @ r
    done = 0
    for _ in range(iters):
        if rr < residual_tol:
            break
        Ap = fvp(p)
        alpha = rr / (p @ Ap)
        x += alpha * p
        r -= alpha * Ap
        rr_new = r @ r
        p = r + (rr_new / rr) * p
        rr = rr_new
        done += 1
    return x, done


def max_step(direction: torch.Tensor, f_direction: torch.Tensor, max_kl: float) -> torch.Tensor:
    """The step along `direction` x that reaches the trust region's edge in the quadratic model:

        1/2 (beta x)^T F (beta x) = delta   =>   beta = sqrt(2 delta / x^T F x),   s = beta x

    `f_direction` is F x (damped, as CG solved with it). Shape: (P,) -> (P,).
    """
    shs = float(direction @ f_direction)
    if not shs > 0.0:  # a zero gradient (every advantage 0): no step
        return torch.zeros_like(direction)
    return math.sqrt(2.0 * max_kl / shs) * direction


@dataclass
class LineSearchResult:
    """The accepted step fraction (None: none was, the parameters stay) and every trial."""

    fraction: float | None
    loss: float
    """The loss at the accepted fraction (the old loss when none was accepted)."""
    kl: float
    """The mean KL at the accepted fraction (0 when none was accepted)."""
    trials: list[tuple[float, float, float]] = field(default_factory=list)
    """(fraction, loss, kl) of each tried fraction, in order."""


def line_search(evaluate: Callable[[float], tuple[float, float]], loss_old: float, *, max_kl: float,
                backtrack_ratio: float, steps: int) -> LineSearchResult:
    """Backtracking line search: the first fraction f in 1, r, r^2, ..., r^(steps-1) of the full step
    whose parameters theta_old + f s both improve the loss and keep the mean KL in the region:

        L(theta_old + f s) < L(theta_old)   and   KLbar(theta_old + f s) <= delta

    `evaluate(f)` puts the parameters at theta_old + f s and returns (L, KLbar) there (the caller
    restores theta_old when the result's fraction is None).
    """
    trials = []
    for k in range(steps):
        f = backtrack_ratio ** k
        loss, kl = evaluate(f)
        trials.append((f, loss, kl))
        if loss < loss_old and kl <= max_kl:
            return LineSearchResult(f, loss, kl, trials)
    return LineSearchResult(None, loss_old, 0.0, trials)


def categorical_kl(old_logp: torch.Tensor, new_logp: torch.Tensor) -> torch.Tensor:
    """KL(p_old || p_new) = sum_a p_old(a) (log p_old(a) - log p_new(a)) over the last axis.

    Shape: (..., V) log-softmax tensors -> (...).
    """
    return (old_logp.exp() * (old_logp - new_logp)).sum(-1)
