"""The run summary and the report: values recomputed from the raw artifacts, the report rewritten
after every iteration, panels chosen by what carries information, and the HTML page in a real
headless browser."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import polars as pl
import pytest

from rlpipe.pipelines.report import (
    curves_figure,
    iteration_metrics,
    run_table,
    sample_completions,
    shown_panels,
    step_metrics,
)
from rlpipe.pipelines.report_html import REFRESH_SECONDS
from rlpipe.pipelines.sinks import PLOT_SHARE, report_due
from rlpipe.schemas import METRICS, read_manifest, read_table_artifact, write_table_artifact

CHROMIUM = Path("/usr/bin/chromium")


def _frame(path: Path) -> pl.DataFrame:
    return pl.from_arrow(read_table_artifact(path))


def test_summary_is_recomputed_from_the_artifacts(mini_run):
    run = mini_run.run_dir
    table = run_table(run)
    assert table["iteration"].to_list() == [1, 2]  # iteration n is iter_{n-1:04d}
    for n, row in zip((1, 2), table.iter_rows(named=True), strict=True):
        it = run / f"iter_{n - 1:04d}"
        scores, rollouts, metrics = _frame(it / "scores"), _frame(it / "rollouts"), _frame(it / "metrics")
        assert row["reward_mean"] == pytest.approx(scores["reward"].mean(), abs=0, rel=1e-12)
        assert row["accuracy"] == pytest.approx(scores["reward__correct"].mean(), rel=1e-12)
        assert row["response_length"] == pytest.approx(rollouts["response_token_ids"].list.len().mean())
        # optimiser metrics: the mean over the optimizer steps (step >= 1)
        steps = metrics.filter(pl.col("step") > 0)
        entropy = steps.filter(pl.col("name") == "entropy")["value"]
        assert row["entropy"] == pytest.approx(entropy.mean(), rel=1e-12) and entropy.len() == 1
        assert row["optimizer_steps"] == 1
        # one step on recomputed old log-probs: KL/clip to the rollout policy are 0 by construction
        assert "approx_kl" not in row or row["approx_kl"] is None
        assert "kl_ref" not in table.columns  # no reference model in this preset
        eval_acc = _frame(it / "eval").filter(pl.col("name") == "accuracy")["value"][0]
        assert row["eval_accuracy"] == eval_acc
        assert row["seconds_optimize"] == max(read_manifest(it / a).wall_time_s for a in ("policy", "metrics"))
        assert row["seconds_rollout"] == read_manifest(it / "rollouts").wall_time_s
    # the console line shows the same numbering and numbers
    last = [line for line in mini_run.lines if line.startswith("iter ")][-1]
    assert last.startswith("iter   2/2") and f"ent {table['entropy'][1]:.3f}" in last
    assert mini_run.records[1].metrics == iteration_metrics(run, 1)


def test_run_table_rows_follow_the_artifacts_they_are_computed_from(mini_run, tmp_path):
    """Rows are computed once per state of an iteration's artifacts (the live report rebuilds the
    table every iteration): a rewritten or removed artifact is seen at once."""
    run = shutil.copytree(mini_run.run_dir, tmp_path / "run")
    before = run_table(run)
    assert run_table(run).equals(before)
    it = run / "iter_0001"
    # rewrite iteration 2's metrics with another entropy (a rerun's manifest replaces the old one)
    metrics = _frame(it / "metrics").with_columns(
        pl.when(pl.col("name") == "entropy").then(pl.col("value") + 1.0).otherwise(pl.col("value")).alias("value"))
    shutil.rmtree(it / "metrics")
    write_table_artifact(it / "metrics", METRICS, metrics.to_arrow(), stage="optimize",
                         config=read_manifest(mini_run.run_dir / "iter_0001" / "metrics").config)
    after = run_table(run)
    assert after["entropy"][1] == pytest.approx(before["entropy"][1] + 1.0, rel=1e-12)
    assert after["entropy"][0] == before["entropy"][0]
    shutil.rmtree(it / "eval")
    assert run_table(run)["eval_accuracy"][1] is None


def test_report_is_live_from_the_first_iteration_and_final_at_the_end(mini_run):
    first = mini_run.pages_during_run[0]  # (the first iteration always writes it)
    assert "http-equiv='refresh'" in first and "; 1 iteration(s)" in first
    assert first.count("<tr><td class='num'>") == 1  # one table row per finished iteration
    final = (mini_run.run_dir / "report" / "index.html").read_text()
    assert "refresh" not in final and "finished; 2 iteration(s)" in final
    md = (mini_run.run_dir / "report" / "metrics.md").read_text()
    assert "| iteration | reward_mean |" in md
    assert [line.split(" | ")[0] for line in md.splitlines() if re.match(r"\| \d", line)] == ["| 1", "| 2"]


def test_the_live_report_is_written_when_a_reload_can_show_it():
    """Tables: the first time, then REFRESH_SECONDS after the last write; the plot also at most
    1/PLOT_SHARE of the run (a 2 s plot: every 200 s)."""
    assert report_due(0.0, None, interval=REFRESH_SECONDS)
    assert not report_due(100.0 + REFRESH_SECONDS - 0.01, 100.0, interval=REFRESH_SECONDS)
    assert report_due(100.0 + REFRESH_SECONDS, 100.0, interval=REFRESH_SECONDS)
    assert not report_due(100.0 + 199.0, 100.0, interval=REFRESH_SECONDS, cost=2.0, share=PLOT_SHARE)
    assert report_due(100.0 + 200.0, 100.0, interval=REFRESH_SECONDS, cost=2.0, share=PLOT_SHARE)


def test_sample_completions_join_rewards_to_rollouts(mini_run):
    it = mini_run.run_dir / "iter_0001"
    samples = sample_completions(mini_run.run_dir, 1, n=5)
    rollouts = _frame(it / "rollouts").sort("sample_index", "group_id").head(5)
    # the 4 prompts' first samples, then the first prompt's second sample
    assert rollouts.select("sample_index", "group_id").rows() == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]
    scores = _frame(it / "scores")
    assert samples["prompt"].to_list() == rollouts["prompt"].to_list()
    assert samples["response"].to_list() == rollouts["response"].to_list()
    expected = [scores.filter((pl.col("group_id") == g) & (pl.col("sample_index") == s))["reward"][0]
                for g, s in rollouts.select("group_id", "sample_index").iter_rows()]
    assert samples["reward"].to_list() == pytest.approx(expected)


def _metrics_artifact(path: Path, per_step: dict[str, list[float]], recompute: bool) -> None:
    """A metrics artifact with optimizer steps 1..S of `per_step` and the step-0 'steps' count."""
    n_steps = len(next(iter(per_step.values())))
    rows = [(0, "steps", float(n_steps))]
    rows += [(s + 1, name, v[s]) for name, v in per_step.items() for s in range(n_steps)]
    table = {"run": ["r"] * len(rows), "iteration": [0] * len(rows), "stage": ["optimize"] * len(rows),
             "step": [r[0] for r in rows], "name": [r[1] for r in rows], "value": [r[2] for r in rows]}
    write_table_artifact(path, METRICS, table, stage="optimize", config={"recompute_old_logprobs": recompute})


def test_step_metrics_average_over_steps_and_drop_what_is_zero_by_construction(tmp_path):
    _metrics_artifact(tmp_path / "a", {"approx_kl": [0.0, 0.02, 0.04], "value_loss": [3.0, 2.0, 1.0]}, True)
    assert step_metrics(tmp_path / "a") == {"steps": 3.0, "optimizer_steps": 3.0,
                                            "approx_kl": pytest.approx(0.02), "value_loss": pytest.approx(2.0)}
    _metrics_artifact(tmp_path / "b", {"approx_kl": [0.0], "clip_fraction": [0.0], "entropy": [1.5]}, True)
    assert step_metrics(tmp_path / "b") == {"steps": 1.0, "optimizer_steps": 1.0, "entropy": 1.5}
    # old log-probs from the rollout engine: the first step measures the engine/trainer gap, kept
    _metrics_artifact(tmp_path / "c", {"approx_kl": [1e-4], "clip_fraction": [0.0]}, False)
    assert set(step_metrics(tmp_path / "c")) == {"steps", "optimizer_steps", "approx_kl", "clip_fraction"}


def test_ppo_panels_and_integer_iteration_ticks(tmp_path):
    """Two PPO-like iterations (several steps, a critic, a reference): the value panels and the
    KL panels show; the x axis has integer ticks only."""
    for k in range(2):
        _metrics_artifact(tmp_path / f"iter_{k:04d}" / "metrics",
                          {"approx_kl": [0.0, 0.01 * (k + 1)], "clip_fraction": [0.0, 0.1], "kl_ref": [0.1, 0.2],
                           "value_loss": [1.0, 0.5], "value_clip_fraction": [0.2, 0.1],
                           "explained_variance": [0.1, 0.3 + k]}, True)
    table = run_table(tmp_path)
    assert table["approx_kl"].to_list() == pytest.approx([0.005, 0.01])
    assert shown_panels(table) == ["kl_ref", "approx_kl", "clip_fraction", "value_loss",
                                   "explained_variance", "value_clip_fraction"]
    fig = curves_figure(table, {}, "t")
    for ax in fig.axes[:6]:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    # GRPO-like: one step, no critic, no reference: none of those panels
    _metrics_artifact(tmp_path / "grpo" / "iter_0000" / "metrics", {"approx_kl": [0.0], "entropy": [2.0]}, True)
    assert shown_panels(run_table(tmp_path / "grpo")) == ["entropy"]


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.mark.skipif(not CHROMIUM.is_file(), reason="needs /usr/bin/chromium (`make chromium` installs it)")
def test_html_report_in_headless_chromium(mini_run, tmp_path):
    page = shutil.copytree(mini_run.run_dir / "report", tmp_path / "report") / "index.html"
    flags = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    table = run_table(mini_run.run_dir)
    assert re.search(r'<img id="curves" alt="training curves" src="data:image/png;base64,[A-Za-z0-9+/=]{1000,}"', dom)
    body = dom.split('<table id="iterations">', 1)[1].split("</table>", 1)[0]
    assert body.count("<tr>") == 1 + table.height  # header + one row per iteration
    assert f"<td class=\"num\">{table['entropy'][1]:.4g}</td>" in body
    samples = sample_completions(mini_run.run_dir, 1)
    assert '<table id="samples">' in dom and "Sample completions, iteration 2" in dom
    assert f">{samples['prompt'][0]}</td>" in dom
    assert "error" not in dom.lower()
    shot = tmp_path / "report.png"
    subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1200,900", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert _png_size(shot) == (1200, 900)
