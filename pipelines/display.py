"""How a run's numbers are shown, wherever they are (`rlpipe inspect`, the report's metrics.md,
curves.png and index.html, the metric sinks, the Prefect artifacts): the per-iteration summary's
columns with their labels and titles, the note that defines them, and the text of a cell.
`report.py` computes the summary; `report_html.py` and the others lay it out.
"""

from __future__ import annotations

from typing import Any

#: The per-iteration summary in display order: column -> (short label, plot title). Columns a
#: run does not produce are absent (no critic: no value_*; no reference: no kl_ref). After these
#: come the other eval_* metrics and seconds_<stage> (wall time of each stage, from its manifest).
COLUMNS: dict[str, tuple[str, str]] = {
    "iteration": ("iter", "iteration"),
    "reward_mean": ("reward", "reward (mean)"),
    "reward_std": ("rew std", "reward (std)"),
    "accuracy": ("acc", "train accuracy"),
    "eval_accuracy": ("eval acc", "held-out accuracy"),
    "response_length": ("resp len", "response length (tokens the model sampled)"),
    "truncated_fraction": ("trunc", "truncated fraction"),
    "turns_mean": ("turns", "model turns per episode"),
    "tool_calls_mean": ("tools", "tool calls per episode"),
    "eval_tool_calls_per_episode": ("eval tools", "held-out tool calls per episode"),
    "staleness": ("stale", "policies between sampling and training (async)"),
    "logprob_gap_mean_abs": ("lp gap", "|trainer - rollout engine| log-prob"),
    "loss": ("loss", "loss"),
    "kl_ref": ("kl ref", "KL to reference"),
    "approx_kl": ("kl old", "approx KL to rollout policy"),
    "clip_fraction": ("clip", "clip fraction"),
    "entropy": ("entropy", "entropy"),
    "grad_norm": ("grad", "grad norm"),
    "value_loss": ("v loss", "value loss"),
    "value_clip_fraction": ("v clip", "value clip fraction"),
    "explained_variance": ("expl var", "explained variance"),
    "optimizer_steps": ("steps", "optimizer steps"),
}

#: How the report's numbers are defined, printed with them.
NOTE = ("Iteration n is directory iter_{n-1:04d} (0: before training); optimiser metrics are means "
        "over the iteration's optimizer steps; seconds_<stage>: wall time of each stage.")


def format_value(value: Any) -> str:
    """A summary cell: floats to 4 significant digits, missing as '-'."""
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def printable(text: str) -> str:
    """Text on one line: control and line-separator characters as escapes ('\\n', '\\x1e')."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)
