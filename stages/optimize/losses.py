"""Policy losses and their registry, the one aggregation function, and the clipped value loss.

Pure tensor math: no IO, no process groups. Every function takes (B, T) tensors left-aligned per
response with `mask[b, t] = 1` on real response tokens. Each policy loss is registered with its
config variant (`@register_policy_loss(PPOClipLoss)`, config.py), whose fields are exactly the
function's keyword knobs; `policy_loss(config, ...)` dispatches on the variant's `name`.

Notation:
    logp       log pi_theta(a_t | s_t) of the policy being trained        (B, T)
    old_logp   log pi_old(a_t | s_t) of the behaviour policy              (B, T)
    A          per-token advantage                                        (B, T)
    rho_t      exp(logp_t - old_logp_t), the importance ratio             (B, T)

Policy losses return the per-token loss matrix `l[b, t]` (reduce it with `agg_loss`) plus detached
per-token statistics (`ratio`, `clipped`, ...), so callers can aggregate the statistics with the
same global denominators as the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch

from rlpipe.stages.common.cli import import_function
from rlpipe.stages.optimize.config import CustomLoss, GSPOLoss, LossConfig, PPOClipLoss, TRPOLoss

AggMode = Literal["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
                              "seq-mean-token-sum-norm")


class PolicyLossOutput(NamedTuple):
    """Per-token loss and detached per-token statistics.

    Shapes: all (B, T); zero where masked.
    """

    loss_mat: torch.Tensor
    """l[b, t], differentiable w.r.t. logp."""
    ratio: torch.Tensor
    """The ratio used for the token (rho_t for ppo_clip, s_i for gspo), detached."""
    clipped: torch.Tensor
    """1.0 where the clipped branch is active (the token's gradient is cut by the clip), detached."""
    dual_clipped: torch.Tensor
    """1.0 where the dual clip bound -c * A was taken (A < 0), detached."""


PolicyLoss = Callable[..., PolicyLossOutput]
POLICY_LOSSES: dict[str, tuple[type[PPOClipLoss | GSPOLoss | TRPOLoss | CustomLoss], PolicyLoss]] = {}
"""name -> (config variant, loss function `fn(logp, old_logp, advantages, mask, **knobs)`)."""


def register_policy_loss(config: type) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register a policy loss under its config variant's name; the variant's fields (but `name`)
    must be the function's keyword parameters. Registering a name twice raises."""
    name = config.model_fields["name"].default

    def deco(fn: PolicyLoss) -> PolicyLoss:
        config.check_function(fn, POLICY_LOSSES, "policy loss")
        POLICY_LOSSES[name] = (config, fn)
        return fn

    return deco


def policy_loss(loss: LossConfig, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor) -> PolicyLossOutput:
    """Dispatch to the policy loss registered under `loss.name`, with the variant's knobs."""
    try:
        _, fn = POLICY_LOSSES[loss.name]
    except KeyError:
        raise ValueError(f"unknown policy loss {loss.name!r}; known: {sorted(POLICY_LOSSES)}") from None
    return fn(logp, old_logp, advantages, mask, **loss.knobs())


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                       eps_low: float, eps_high: float, dual_clip: float | None) -> PolicyLossOutput:
    """The PPO clipped surrogate for a given ratio (token or sequence level, broadcast to (B, T))."""
    # l_t = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) = max(-rho A, -clip(rho) A)
    unclipped = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = (clipped_loss > unclipped).float()
    dual = torch.zeros_like(loss)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        # Dual clip (Ye et al. 2020, https://arxiv.org/abs/1912.09729): for A < 0, l = min(l, -c A)
        bound = -dual_clip * advantages
        take = (advantages < 0) & (bound < loss)
        loss = torch.where(take, bound, loss)
        dual = take.float()
    m = mask.to(loss.dtype)
    return PolicyLossOutput(loss * m, ratio.detach() * m, clipped * m, dual * m)


@register_policy_loss(PPOClipLoss)
def ppo_clip(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
             eps_low: float, eps_high: float, dual_clip: float | None) -> PolicyLossOutput:
    """PPO clipped surrogate, token level (Schulman et al. 2017, https://arxiv.org/abs/1707.06347).

    `eps_high > eps_low` is DAPO's clip-higher (https://arxiv.org/abs/2503.14476, 0.28 / 0.2).

    Args:
        logp, old_logp, advantages, mask: (B, T).
        eps_low, eps_high: the ratio is clipped to [1 - eps_low, 1 + eps_high].
        dual_clip: c > 1 bounds the loss of negative-advantage tokens by -c * A; None disables it.

    Shape:
        every input and output (B, T).
    """
    # rho_t = exp(logp_t - old_logp_t); exp(0) == 1 exactly, so a fresh ratio is exactly 1.
    ratio = torch.exp((logp - old_logp) * mask)
    return _clipped_surrogate(ratio, advantages, mask, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)


@register_policy_loss(GSPOLoss)
def gspo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
         eps_low: float, eps_high: float) -> PolicyLossOutput:
    """GSPO: sequence-level ratio (Zheng et al. 2025, https://arxiv.org/abs/2507.18071).

    s_i = exp(mean_t(logp - old_logp)) over the response's tokens replaces rho_t for every token of
    response i, and is clipped to [1 - eps_low, 1 + eps_high] (the paper uses 3e-4 / 4e-4).

    Shape:
        every input and output (B, T).
    """
    m = mask.to(logp.dtype)
    n = m.sum(-1).clamp(min=1.0)
    # s_i = exp( sum_t (logp - old_logp) m / |y_i| ), broadcast over the tokens of response i
    seq_ratio = torch.exp(((logp - old_logp) * m).sum(-1) / n)
    ratio = seq_ratio.unsqueeze(-1).expand_as(logp)
    return _clipped_surrogate(ratio, advantages, mask, eps_low=eps_low, eps_high=eps_high, dual_clip=None)


@register_policy_loss(TRPOLoss)
def trpo_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                   max_kl: float, cg_iters: int, cg_damping: float, backtrack_ratio: float,
                   backtrack_steps: int) -> PolicyLossOutput:
    """TRPO's surrogate, unclipped: l_t = -rho_t A_t (Schulman et al. 2015,
    https://arxiv.org/abs/1502.05477). The trust region is the KL constraint of the step
    (trpo.py, driven by trpo_step.py), so the step's knobs are not used here.

    Shape:
        every input and output (B, T).
    """
    ratio = torch.exp((logp - old_logp) * mask)
    m = mask.to(ratio.dtype)
    zeros = torch.zeros_like(m)
    return PolicyLossOutput(-advantages * ratio * m, ratio.detach() * m, zeros, zeros)


@register_policy_loss(CustomLoss)
def custom_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                function: str, kwargs: dict) -> PolicyLossOutput:
    """A user loss `fn(logp, old_logp, advantages, mask, **kwargs)` returning the (B, T) per-token
    loss (or a `PolicyLossOutput`); its statistics default to the token ratio, nothing clipped.

    Shape:
        every input and output (B, T).
    """
    fn = import_function(function, "loss.function")
    out = fn(logp, old_logp, advantages, mask, **kwargs)
    loss = out.loss_mat if isinstance(out, PolicyLossOutput) else out
    if not isinstance(loss, torch.Tensor) or loss.shape != logp.shape:
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss.function {function!r} returned {got}; expected the per-token loss, a tensor "
                         f"of shape {tuple(logp.shape)} like logp")
    if logp.requires_grad and not loss.requires_grad:
        raise ValueError(f"loss.function {function!r} returned a loss with no gradient w.r.t. logp")
    if isinstance(out, PolicyLossOutput):
        return out
    m = mask.to(loss.dtype)
    ratio = torch.exp((logp.detach() - old_logp) * m)  # rho_t, for the logged ratio_mean
    zeros = torch.zeros_like(m)
    return PolicyLossOutput(loss * m, ratio * m, zeros, zeros)


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", *,
             global_token_count: float | torch.Tensor | None = None,
             global_seq_count: float | torch.Tensor | None = None,
             max_len: int | None = None) -> torch.Tensor:
    """Reduce a per-token matrix to a scalar: the one aggregation function (verl's `agg_loss`).

    Modes (N = token count, S = sequence count, T_b = tokens of response b, L = max_len):
        token-mean               sum_{b,t} l m / N                       (default; DAPO)
        token-sum                sum_{b,t} l m                           (no normalisation)
        seq-mean-token-mean      sum_b [sum_t l m / T_b] / S             (original GRPO)
        seq-mean-token-sum       sum_b [sum_t l m] / S
        seq-mean-token-sum-norm  sum_b [sum_t l m / L] / S               (Dr. GRPO, L constant)

    Under gradient accumulation and several ranks pass the global N (or S) of the whole optimizer
    step: each micro-batch then contributes its exact share, and the sum of the micro-batch losses
    equals the loss of the whole batch. Without them the local counts are used. Sequences with no
    token count in neither S nor any sum.

    Args:
        loss_mat, mask: (B, T).
        max_len: L for seq-mean-token-sum-norm (a constant, e.g. the max response length); defaults
            to T of this tensor, which is NOT invariant to micro-batching.

    Shape:
        loss_mat, mask (B, T) -> scalar.
    """
    m = mask.to(loss_mat.dtype)
    masked = loss_mat * m
    if mode == "token-mean":
        n = m.sum() if global_token_count is None else global_token_count
        return masked.sum() / n
    if mode == "token-sum":
        return masked.sum()
    lens = m.sum(-1)
    s = (lens > 0).sum() if global_seq_count is None else global_seq_count
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / lens.clamp(min=1.0)).sum() / s
    if mode == "seq-mean-token-sum":
        return masked.sum(-1).sum() / s
    if mode == "seq-mean-token-sum-norm":
        L = loss_mat.shape[-1] if max_len is None else max_len
        return (masked.sum(-1) / L).sum() / s
    raise ValueError(f"unknown aggregation mode {mode!r}; known: {list(AGG_MODES)}")


class ValueLossOutput(NamedTuple):
    """Per-token clipped value loss and the detached fraction where the clipped term is larger."""

    loss_mat: torch.Tensor
    clipped: torch.Tensor


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       mask: torch.Tensor, *, clip_eps: float | None = 0.2) -> ValueLossOutput:
    """PPO critic loss with value clipping (as in OpenAI baselines' ppo2).

    l_t = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2); with clip_eps None
    it is 0.5 * (V - R)^2.

    Shape:
        every input and output (B, T).
    """
    m = mask.to(values.dtype)
    unclipped = (values - returns) ** 2
    if clip_eps is None:
        return ValueLossOutput(0.5 * unclipped * m, torch.zeros_like(m))
    v_clip = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    clipped = (v_clip - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped, clipped)
    return ValueLossOutput(loss * m, (clipped > unclipped).float().detach() * m)


def value_moments(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sums for explained variance that add up across micro-batches and ranks (detached).

    Returns [n, sum R, sum R^2, sum D, sum D^2] with D = R - V over the masked tokens.

    Shape:
        values, returns, mask (B, T) -> (5,).
    """
    m = mask.to(torch.float64)
    r = returns.detach().to(torch.float64) * m
    d = (returns.detach() - values.detach()).to(torch.float64) * m
    return torch.stack([m.sum(), r.sum(), (r * r).sum(), d.sum(), (d * d).sum()])


def explained_variance(moments: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) from `value_moments` sums (population variances); nan if Var(R) == 0.

    Shape:
        moments (5,) -> float.
    """
    n, s_r, s_r2, s_d, s_d2 = (float(x) for x in moments)
    var_r = s_r2 / n - (s_r / n) ** 2
    var_d = s_d2 / n - (s_d / n) ** 2
    return 1.0 - var_d / var_r if var_r > 0 else float("nan")
