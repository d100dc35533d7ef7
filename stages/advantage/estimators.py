"""Advantage estimators: pure tensor functions and their registry.

Notation: B responses; response b has T_b tokens, right-padded to T = max_b T_b; `mask[b, t]` is
1.0 on real tokens (a left-aligned prefix of each row) and 0.0 on padding; `group_ids[b]` names the
prompt whose G samples form a group. Group statistics use scatter ops over `group_ids` (no Python
loop over groups); GAE is a reverse scan over time, vectorised over the batch. Padding never
enters a sum, a mean or a std.

Two layers:
- the math: `grpo`, `dr_grpo`, `rloo`, `reinforce_pp_baseline`, `gae`, `masked_whiten`, with
  natural signatures (tensors in, tensors out);
- `ADVANTAGE_ESTIMATORS`: name -> `Estimator` (config variant, adapter). Each adapter
  `fn(inputs: AdvantageInputs, **knobs)` is registered with `@register_estimator(<variant>)`,
  the config class in config.py whose fields are exactly its keyword knobs (checked when
  registering); it adapts one math function to the common `AdvantageInputs -> AdvantageOutputs`
  shape, so the stage dispatches every estimator the same way (`compute_advantages`). The
  variant's `name` is the registry key; registering a name twice raises.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from rlpipe.stages.advantage.config import (
    STD_EPS,
    CustomEstimator,
    DrGRPOEstimator,
    EstimatorConfig,
    GAEEstimator,
    GRPOEstimator,
    ReinforcePPBaselineEstimator,
    RLOOEstimator,
    ScaleKind,
    StdKind,
)
from rlpipe.stages.common.cli import import_function


# ---------------------------------------------------------------------------------------------
# Group statistics and masked moments
# ---------------------------------------------------------------------------------------------
class GroupStats(NamedTuple):
    """Per-sample views of per-group statistics (all shape (B,))."""

    index: torch.Tensor
    """Dense group index 0..G-1 of each sample (groups numbered in sorted group_id order)."""
    count: torch.Tensor
    """n_g: samples in the sample's group."""
    mean: torch.Tensor
    """mean_g of the rewards of the sample's group."""
    ssd: torch.Tensor
    """sum_{j in g} (r_j - mean_g)^2 of the sample's group."""
    no_signal: torch.Tensor
    """True where the group has one sample or all its rewards are equal (bool)."""


def group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> GroupStats:
    """Group count, mean, sum of squared deviations and degeneracy, broadcast back to samples.

    Shape:
        rewards, group_ids: (B,); every field of the result: (B,).
    """
    index = torch.unique(group_ids, return_inverse=True)[1]
    n_groups = int(index.max()) + 1 if index.numel() else 0
    zeros = rewards.new_zeros(n_groups)
    count = zeros.scatter_add(0, index, torch.ones_like(rewards))  # n_g
    mean = zeros.scatter_add(0, index, rewards) / count.clamp(min=1)  # mean_g = sum_g r / n_g
    ssd = zeros.scatter_add(0, index, (rewards - mean[index]) ** 2)  # sum_g (r - mean_g)^2
    # Equality is tested exactly (max == min), not by a variance threshold: rounding in mean_g
    # would leave tiny non-zero deviations in a group of equal rewards.
    gmax = zeros.scatter_reduce(0, index, rewards, "amax", include_self=False)
    gmin = zeros.scatter_reduce(0, index, rewards, "amin", include_self=False)
    no_signal = (gmax == gmin) | (count < 2)
    return GroupStats(index, count[index], mean[index], ssd[index], no_signal[index])


def _std(ssd: torch.Tensor, n: torch.Tensor, std: StdKind) -> torch.Tensor:
    """sqrt(ssd / (n - 1)) for 'sample', sqrt(ssd / n) for 'population' (0 where undefined)."""
    if std not in ("sample", "population"):
        raise ValueError(f"std must be 'sample' or 'population', got {std!r}")
    dof = n - 1 if std == "sample" else n
    return torch.sqrt(ssd / dof.clamp(min=1))


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(x * mask) / sum(mask) over all elements (0 when the mask is empty).

    Shape:
        x, mask: any equal shapes; result: ().
    """
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, eps: float = STD_EPS) -> torch.Tensor:
    """(x - mu) / (sigma + eps) with mu, sigma over the masked elements only; 0 on padding.

    sigma is the sample std (n - 1 denominator), as verl's `masked_whiten` and torchtune's `whiten`.

    Shape:
        x, mask: (B, T); result: (B, T).
    """
    n = mask.sum()
    mu = masked_mean(x, mask)  # mu = sum(x m) / sum(m)
    var = (((x - mu) * mask) ** 2).sum() / (n - 1).clamp(min=1)  # sigma^2 = sum(m (x - mu)^2) / (n - 1)
    return (x - mu) / (var.sqrt() + eps) * mask


# ---------------------------------------------------------------------------------------------
# The estimators (math)
# ---------------------------------------------------------------------------------------------
class GroupAdvantages(NamedTuple):
    advantages: torch.Tensor
    """A_i, one per response, shape (B,)."""
    no_signal: torch.Tensor
    """True for responses in a zero-variance or size-1 group, shape (B,) bool."""


def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, *, std: StdKind, scale: ScaleKind,
         eps: float = STD_EPS) -> GroupAdvantages:
    """GRPO: `A_i = (r_i - mean_g) / (std_g + eps)`.

    Shao et al. 2024 (DeepSeekMath), https://arxiv.org/abs/2402.03300. A group of equal rewards
    or of one sample gives A = 0 and is flagged in `no_signal`.

    Args:
        rewards: sequence rewards r_i.
        group_ids: group of each response.
        std: 'sample' (n - 1; TRL, verl) or 'population' (n).
        scale: 'group' divides by the group's std, 'batch' by the std of all rewards of the batch
            (TRL's `scale_rewards="batch"`), 'none' does not divide (as Dr. GRPO).
        eps: added to the std.

    Shape:
        rewards, group_ids: (B,); advantages, no_signal: (B,).
    """
    g = group_stats(rewards, group_ids)
    centered = rewards - g.mean  # r_i - mean_g
    if scale == "group":
        denom = _std(g.ssd, g.count, std) + eps  # std_g + eps
    elif scale == "batch":
        n = rewards.new_tensor(float(rewards.numel()))
        denom = _std(((rewards - rewards.mean()) ** 2).sum(), n, std) + eps  # std_batch + eps
    elif scale == "none":
        denom = rewards.new_ones(())
    else:
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    advantages = torch.where(g.no_signal, torch.zeros_like(rewards), centered / denom)
    return GroupAdvantages(advantages, g.no_signal)


def dr_grpo(rewards: torch.Tensor, group_ids: torch.Tensor) -> GroupAdvantages:
    """Dr. GRPO: `A_i = r_i - mean_g` (no std scaling).

    Liu et al. 2025, "Understanding R1-Zero-Like Training", https://arxiv.org/abs/2503.20783.

    Shape:
        rewards, group_ids: (B,); advantages, no_signal: (B,).
    """
    g = group_stats(rewards, group_ids)
    advantages = torch.where(g.no_signal, torch.zeros_like(rewards), rewards - g.mean)
    return GroupAdvantages(advantages, g.no_signal)


def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> GroupAdvantages:
    """RLOO: `A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_g)`.

    Ahmadian et al. 2024, "Back to Basics", https://arxiv.org/abs/2402.14740 (Kool et al. 2019).
    A group of one sample has no leave-one-out baseline: A = 0.

    Shape:
        rewards, group_ids: (B,); advantages, no_signal: (B,).
    """
    g = group_stats(rewards, group_ids)
    factor = g.count / (g.count - 1).clamp(min=1)  # G / (G - 1)
    advantages = torch.where(g.no_signal, torch.zeros_like(rewards), factor * (rewards - g.mean))
    return GroupAdvantages(advantages, g.no_signal)


def reinforce_pp_baseline(rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, *,
                          eps: float = STD_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: `r_i - mean_g` on every token, then whitened over all response
    tokens of the batch (masked mean and sample std; padding excluded).

    Hu et al. 2025, https://arxiv.org/abs/2501.03262. Unlike grpo, a zero-variance group's
    advantage is 0 only before whitening (the batch mean is then subtracted); it is still flagged.

    Returns:
        (token advantages (B, T), no_signal (B,) bool).

    Shape:
        rewards, group_ids: (B,); mask: (B, T).
    """
    g = group_stats(rewards, group_ids)
    centered = torch.where(g.no_signal, torch.zeros_like(rewards), rewards - g.mean)
    mask = mask.to(rewards.dtype)
    return masked_whiten(centered.unsqueeze(-1) * mask, mask, eps=eps), g.no_signal


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (before whitening).

        delta_t = r_t + gamma * V_{t+1} - V_t          (V after the last real token is 0)
        A_t     = sum_l (gamma * lambda)^l * delta_{t+l} = delta_t + gamma * lambda * A_{t+1}
        R_t     = A_t + V_t

    Schulman et al. 2016, https://arxiv.org/abs/1506.02438. Runs one reverse scan over T,
    vectorised over the batch; padded positions (any values there) read as 0 and give 0.

    Returns:
        (advantages A_t, returns R_t), both (B, T), 0 on padding.

    Shape:
        token_rewards, values, mask: (B, T).
    """
    mask = mask.to(values.dtype)
    v = values * mask
    r = token_rewards * mask
    next_v = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)  # V_{t+1}; 0 after the end
    delta = (r + gamma * next_v - v) * mask  # delta_t
    advantages = torch.zeros_like(v)
    running = torch.zeros_like(v[:, 0])
    for t in reversed(range(v.shape[1])):
        running = delta[:, t] + gamma * lam * running  # A_t = delta_t + gamma lambda A_{t+1}
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, (advantages + v) * mask  # R_t = A_t + V_t


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------
class AdvantageInputs(NamedTuple):
    """Everything an estimator may read. Shapes: B responses, T = max response length."""

    rewards: torch.Tensor
    """(B,) sequence rewards, KL-penalised (`R - beta * sum_t kl_t`) when KL is in the reward."""
    group_ids: torch.Tensor
    """(B,) int64 group of each response."""
    mask: torch.Tensor
    """(B, T) 1.0 on real response tokens."""
    token_rewards: torch.Tensor
    """(B, T) r_t: R on the last token (minus beta * kl_t on every token with KL in the reward)."""
    values: torch.Tensor | None = None
    """(B, T) critic values V_t, or None without a critic."""


class AdvantageOutputs(NamedTuple):
    token_advantages: torch.Tensor
    """(B, T) A_t used by the policy loss; 0 on padding."""
    advantages: torch.Tensor | None
    """(B,) sequence advantage for sequence-level estimators; None for token-level ones."""
    returns: torch.Tensor | None
    """(B, T) returns R_t for estimators with a critic (gae); None otherwise."""
    no_signal: torch.Tensor
    """(B,) bool: response in a zero-variance or size-1 group (all False for gae)."""


@dataclass(frozen=True)
class Estimator:
    """A registered estimator: its config variant and its adapter `fn(inputs, **variant.knobs())`."""

    config: type[GRPOEstimator | DrGRPOEstimator | RLOOEstimator | ReinforcePPBaselineEstimator | GAEEstimator
                  | CustomEstimator]
    fn: Callable[..., AdvantageOutputs]


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(config: type):
    """Decorator adding an adapter `fn(inputs, **knobs) -> AdvantageOutputs` under the name of
    its config variant `config`, whose fields (but `name`) must be `fn`'s keyword parameters."""
    name = config.model_fields["name"].default

    def wrap(fn: Callable[..., AdvantageOutputs]) -> Callable[..., AdvantageOutputs]:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        knobs = set(config.model_fields) - {"name"}
        params = {p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}
        if params != knobs:
            raise TypeError(f"{fn.__qualname__} takes keywords {sorted(params)} but {config.__name__} "
                            f"has knobs {sorted(knobs)}")
        ADVANTAGE_ESTIMATORS[name] = Estimator(config, fn)
        return fn

    return wrap


def _broadcast(seq: GroupAdvantages, mask: torch.Tensor) -> AdvantageOutputs:
    token = seq.advantages.unsqueeze(-1) * mask.to(seq.advantages.dtype)  # A_t = A_i on every token
    return AdvantageOutputs(token, seq.advantages, None, seq.no_signal)


def _no_signal(x: AdvantageInputs) -> torch.Tensor:
    return torch.zeros(x.rewards.shape, dtype=torch.bool, device=x.rewards.device)


@register_estimator(GRPOEstimator)
def _grpo(x: AdvantageInputs, *, std: StdKind, scale: ScaleKind, eps: float) -> AdvantageOutputs:
    return _broadcast(grpo(x.rewards, x.group_ids, std=std, scale=scale, eps=eps), x.mask)


@register_estimator(DrGRPOEstimator)
def _dr_grpo(x: AdvantageInputs) -> AdvantageOutputs:
    return _broadcast(dr_grpo(x.rewards, x.group_ids), x.mask)


@register_estimator(RLOOEstimator)
def _rloo(x: AdvantageInputs) -> AdvantageOutputs:
    return _broadcast(rloo(x.rewards, x.group_ids), x.mask)


@register_estimator(ReinforcePPBaselineEstimator)
def _reinforce_pp_baseline(x: AdvantageInputs, *, eps: float) -> AdvantageOutputs:
    token, no_signal = reinforce_pp_baseline(x.rewards, x.group_ids, x.mask, eps=eps)
    return AdvantageOutputs(token, None, None, no_signal)


@register_estimator(GAEEstimator)
def _gae(x: AdvantageInputs, *, gamma: float, lam: float, whiten: bool, eps: float) -> AdvantageOutputs:
    if x.values is None:
        raise ValueError("estimator 'gae' needs critic values (a reference artifact with `values`)")
    advantages, returns = gae(x.token_rewards, x.values, x.mask, gamma=gamma, lam=lam)
    if whiten:
        advantages = masked_whiten(advantages, x.mask.to(advantages.dtype), eps=eps)
    return AdvantageOutputs(advantages, None, returns, _no_signal(x))


@register_estimator(CustomEstimator)
def _custom(x: AdvantageInputs, *, function: str, kwargs: dict) -> AdvantageOutputs:
    """A user function `fn(inputs, **kwargs)` returning (B,) sequence or (B, T) token advantages."""
    fn = import_function(function, "estimator.function")
    out = fn(x, **kwargs)
    B, T = x.mask.shape
    if not isinstance(out, torch.Tensor) or tuple(out.shape) not in ((B,), (B, T)):
        got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"estimator.function {function!r} returned {got}; expected a tensor of "
                         f"shape ({B},) (one per response) or ({B}, {T}) (one per token)")
    mask = x.mask.to(x.rewards.dtype)
    out = out.detach().to(device=mask.device, dtype=mask.dtype)
    token = out.unsqueeze(-1) * mask if out.ndim == 1 else out * mask  # padding is zeroed
    bad = (~torch.isfinite(token)).any(-1).nonzero()
    if len(bad):
        raise ValueError(f"estimator.function {function!r} returned a non-finite advantage for response {int(bad[0])}")
    return AdvantageOutputs(token, out if out.ndim == 1 else None, None, _no_signal(x))


def compute_advantages(estimator: EstimatorConfig, inputs: AdvantageInputs) -> AdvantageOutputs:
    """Run the registered estimator of config variant `estimator` (name and knobs) on `inputs`."""
    try:
        entry = ADVANTAGE_ESTIMATORS[estimator.name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {estimator.name!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}") from None
    return entry.fn(inputs, **estimator.knobs())
