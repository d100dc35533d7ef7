"""Bradley-Terry reward-model loss (docs/algorithms.md#bradley-terry).

Notation: for B preference pairs, r_c[b] and r_r[b] are the scalar rewards of the chosen and the
rejected response of pair b (read at the last token of prompt+response), m[b] an optional margin.

    L = -mean_b log sigmoid(r_c - r_r - m)  +  c * mean_b (r_c + r_r)^2

The first term is the Bradley-Terry negative log-likelihood of the preference (Ouyang et al. 2022,
https://arxiv.org/abs/2203.02155; the margin as in Llama 2, https://arxiv.org/abs/2307.09288).
The optional centering term (Eisenstein et al. 2023, https://arxiv.org/abs/2312.09244) pulls the
rewards towards zero mean, since the BT loss is invariant to a constant shift.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(
    r_chosen: torch.Tensor,
    r_rejected: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean Bradley-Terry loss of a batch of pairs, plus detached statistics.

    Args:
        r_chosen: rewards of the chosen responses.
        r_rejected: rewards of the rejected responses.
        margin: per-pair margin m (0 where None).
        center_coef: coefficient c of the centering term (0 disables it).

    Returns:
        (loss, stats): the scalar loss (differentiable) and floats `bt_loss`, `accuracy`
        (mean(r_c > r_r)), `reward_chosen`, `reward_rejected`, `reward_margin` (mean r_c - r_r).

    Shape:
        r_chosen, r_rejected, margin: (B,). loss: ().
    """
    diff = r_chosen - r_rejected
    if margin is not None:
        diff = diff - margin
    # L_BT = -mean log sigmoid(r_c - r_r - m); logsigmoid is the stable form of log(1/(1+e^-x))
    bt = -F.logsigmoid(diff).mean()
    loss = bt
    if center_coef:
        # + c * mean((r_c + r_r)^2)
        loss = loss + center_coef * ((r_chosen + r_rejected) ** 2).mean()
    with torch.no_grad():
        stats = {
            "bt_loss": float(bt),
            "accuracy": float((r_chosen > r_rejected).float().mean()),
            "reward_chosen": float(r_chosen.mean()),
            "reward_rejected": float(r_rejected.mean()),
            "reward_margin": float((r_chosen - r_rejected).mean()),
        }
    return loss, stats
