"""Summary numbers of an advantages batch, recorded in the artifact manifest's `extra`."""

from __future__ import annotations

import torch

from rlpipe.stages.advantage.estimators import AdvantageOutputs, masked_mean


def advantage_summary(rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor,
                      out: AdvantageOutputs, kl_t: torch.Tensor | None) -> dict[str, float | int]:
    """Counts and moments: groups, zero-variance groups, reward and advantage statistics, KL.

    Stds are population stds; token statistics are over real response tokens only.

    Shape:
        rewards, group_ids: (B,); mask, kl_t: (B, T).
    """
    B = int(rewards.numel())
    no_signal_groups = torch.unique(group_ids[out.no_signal]).numel() if B else 0
    n_groups = torch.unique(group_ids).numel() if B else 0
    tokens = int(mask.sum())
    a = out.token_advantages
    a_real = a[mask.bool()]
    a_mean = masked_mean(a, mask)
    summary: dict[str, float | int] = {
        "rows": B,
        "groups": n_groups,
        "zero_variance_groups": int(no_signal_groups),
        "zero_variance_fraction": no_signal_groups / n_groups if n_groups else 0.0,
        "response_tokens": tokens,
        "reward_mean": float(rewards.mean()) if B else 0.0,
        "reward_std": float(rewards.std(correction=0)) if B else 0.0,
        "advantage_mean": float(a_mean),
        "advantage_std": float(masked_mean((a - a_mean) ** 2, mask).sqrt()),
        "advantage_min": float(a_real.min()) if tokens else 0.0,
        "advantage_max": float(a_real.max()) if tokens else 0.0,
    }
    if out.returns is not None:
        summary["returns_mean"] = float(masked_mean(out.returns, mask))
    if kl_t is not None:
        summary["kl_token_mean"] = float(masked_mean(kl_t, mask))
        summary["kl_seq_mean"] = float((kl_t * mask).sum(-1).mean()) if B else 0.0
    return summary
