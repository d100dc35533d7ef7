"""Dynamic sampling and ReMax in a whole run: the rollout oversamples and adds each prompt's greedy
response, the filter keeps prompts_per_iteration groups, remax subtracts the greedy reward, and a
run cut short resumes to the same artifacts."""

import json
from pathlib import Path

import pytest
import yaml
from conftest import KEEP_EVERYTHING, MINI

from rlpipe.pipelines.layout import RunLayout
from rlpipe.pipelines.plan import Plan
from rlpipe.pipelines.preset import load_preset
from rlpipe.pipelines.runner import Pipeline
from rlpipe.schemas import read_manifest, read_table_artifact
from rlpipe.schemas.config_files import ConfigError
from rlpipe.schemas.rollouts import GREEDY_SAMPLE_INDEX

PPI, G = MINI["prompts_per_iteration"], MINI["rollout"]["group_size"]
DYNAMIC = {
    **MINI, "name": "dyn",
    "rollout": {**MINI["rollout"], "oversample": 2.0, "greedy_baseline": True},
    # A second component that varies between a micro model's samples, so that some groups pass the
    # filter and others do not.
    "score": {"components": [*MINI["score"]["components"],
                             {"name": "digit", "type": "regex_format", "pattern": "^[0-9]", "weight": 0.5}]},
    "filter": {"drop": "all_equal"},
    "advantage": {"estimator": "remax"},
    "keep": KEEP_EVERYTHING,  # every policy is read; the resume recomputes optimize 1 from policy 0
}


def _manifests(run_dir: Path) -> dict[str, dict]:
    return {str(m.parent.relative_to(run_dir)): json.loads(m.read_text()) for m in sorted(run_dir.rglob("_manifest.json"))}


@pytest.mark.integration
def test_oversampled_filtered_remax_run_keeps_the_batch_size_and_resumes(tmp_path):
    preset_file = tmp_path / "dyn.yaml"
    preset_file.write_text(yaml.safe_dump(DYNAMIC))
    run_dir = tmp_path / "runs" / "dyn"
    Pipeline(load_preset(preset_file), run_dir, log=lambda s: None).run()

    for k in (0, 1):
        it = run_dir / f"iter_{k:04d}"
        rollouts = read_table_artifact(it / "rollouts").to_pylist()
        # 2 x 4 groups, each G samples and its greedy row; iteration k walks prompts [8k, 8k + 8).
        assert len({r["group_id"] for r in rollouts}) == 2 * PPI and len(rollouts) == 2 * PPI * (G + 1)
        assert read_manifest(it / "rollouts").config["prompt_offset"] == k * 2 * PPI
        # The filter: the first PPI groups (group order) whose sampled rewards differ, refilled in
        # group order with dropped ones when too few differ; computed here from the scores.
        scores = read_table_artifact(it / "scores").to_pylist()
        rewards: dict[int, list[float]] = {}
        for r in scores:
            if r["sample_index"] != GREEDY_SAMPLE_INDEX:
                rewards.setdefault(r["group_id"], []).append(r["reward"])
        passing = [g for g in sorted(rewards) if max(rewards[g]) != min(rewards[g])]
        failing = [g for g in sorted(rewards) if g not in passing]
        expected = sorted(passing[:PPI] + failing[:max(PPI - len(passing), 0)])
        kept = read_table_artifact(it / "filtered_scores").to_pylist()
        assert sorted({r["group_id"] for r in kept}) == expected and len(kept) == PPI * (G + 1)
        extra = read_manifest(it / "filtered_scores").extra
        assert extra["groups_in"] == 2 * PPI and extra["groups_kept"] == PPI
        assert extra["groups_passed"] == len(passing)
        # The batch: PPI groups of G samples, no greedy row; A = r - r_greedy of the group.
        adv = read_table_artifact(it / "advantages").to_pylist()
        assert len(adv) == PPI * G and all(r["sample_index"] != GREEDY_SAMPLE_INDEX for r in adv)
        greedy = {r["group_id"]: r["reward"] for r in kept if r["sample_index"] == GREEDY_SAMPLE_INDEX}
        assert all(r["advantage"] == pytest.approx(r["reward"] - greedy[r["group_id"]], abs=1e-6) for r in adv)
        assert read_manifest(it / "policy").inputs["advantages"].path == str(it / "advantages")
    assert any(read_manifest(run_dir / f"iter_{k:04d}" / "filtered_scores").extra["groups_passed"] > 0
               for k in (0, 1)), "no group passed the filter: the run did not exercise it"

    # Resume: iteration 1 cut short after its scores (later manifests gone); the rerun recomputes
    # exactly those and gives the same artifacts.
    before = _manifests(run_dir)
    cut = [p for p in before if p.startswith("iter_0001/") and p.split("/")[1] not in ("rollouts", "scores")]
    assert "iter_0001/filtered_scores" in cut and "iter_0001/advantages" in cut
    for p in cut:
        (run_dir / p / "_manifest.json").unlink()
    Pipeline(load_preset(preset_file), run_dir, log=lambda s: None).run()
    after = _manifests(run_dir)
    assert {p: m["content_hash"] for p, m in after.items()} == {p: m["content_hash"] for p, m in before.items()}
    # (iterations only: the sft stage recomputes on every rerun, its metrics carry no cache key)
    assert [p for p in before if p.startswith("iter_") and p not in cut
            and after[p]["created_at"] != before[p]["created_at"]] == []


def test_oversample_without_a_filter_is_refused(tmp_path):
    preset = {**MINI, "rollout": {**MINI["rollout"], "oversample": 2.0}}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(preset))
    with pytest.raises(ConfigError, match="rollout.oversample is 2.0 but there is no `filter:` section"):
        load_preset(path)
    # With a filter the plan walks the prompts by the groups generated and keeps PPI of them.
    preset["filter"] = {}
    path.write_text(yaml.safe_dump(preset))
    plan = Plan(load_preset(path), RunLayout(tmp_path / "runs" / "mini"))
    calls = {c.name: c.config for c in plan.iteration(3)}
    assert calls["rollout"].prompt_offset == 3 * 2 * PPI and calls["rollout"].group_count() == 2 * PPI
    assert calls["filter"].keep_groups == PPI and calls["advantage"].scores == calls["filter"].output
    assert [c.name for c in plan.iteration(0)][:4] == ["rollout", "score", "filter", "advantage"]
