"""The rollout stage with the transformers engine, run in-process on the tiny policy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlpipe.schemas import ConfigError, load_config, read_manifest, read_table_artifact
from rlpipe.stages.rollout.config import RolloutConfig
from rlpipe.stages.rollout.run import run

SAMPLING = dict(group_size=4, temperature=0.7, top_k=40, top_p=0.9, max_new_tokens=12)



def config(policy: Path, prompts: Path, out: Path, **kw) -> RolloutConfig:
    return RolloutConfig(checkpoint=policy, prompts=prompts, output=out, **(SAMPLING | kw))


@pytest.fixture(scope="module")
def stopped(tiny_policy_dir, prompts_dir, tmp_path_factory):
    """A run with stop strings and stop ids, prompts of different lengths batched together."""
    cfg = config(tiny_policy_dir, prompts_dir, tmp_path_factory.mktemp("r") / "rollouts",
                 batch_size=5, groups_per_shard=5, group_size=6, max_new_tokens=24,
                 temperature=1.0, top_k=0, top_p=1.0, stop=("5", "Q"), stop_token_ids=(40, 41))
    return cfg, run(cfg)


def test_logprobs_match_teacher_forced_and_finish_reasons(stopped, tiny_policy_dir, rollout_check):
    cfg, manifest = stopped
    assert manifest.rows == 12 * 6 and len(manifest.shard_names) == 3
    counts = rollout_check(cfg.output, tiny_policy_dir, group_size=6, max_new_tokens=24,
                            stop=cfg.stop, stop_token_ids=cfg.stop_token_ids)
    # every way of ending occurs in this seeded run, so each branch of the checks ran
    assert all(n > 0 for n in counts.values()), counts


def test_logprobs_are_raw_under_temperature_topk_topp(tiny_policy_dir, prompts_dir, tmp_path, rollout_check):
    """Sampling at T=0.7 with top-k/top-p still stores log pi_theta (T=1, unfiltered)."""
    cfg = config(tiny_policy_dir, prompts_dir, tmp_path / "r", batch_size=12)
    run(cfg)
    rollout_check(cfg.output, tiny_policy_dir, group_size=4, max_new_tokens=12)
    rows = read_table_artifact(cfg.output).to_pylist()
    assert len({len(r["prompt_token_ids"]) for r in rows}) >= 5  # one batch, many prompt lengths
    assert {r["engine"] for r in rows} == {"transformers"}
    assert rows[0]["sampling"] == pytest.approx({"temperature": 0.7, "top_p": 0.9, "top_k": 40, "max_new_tokens": 12})


def test_rows_record_prompts_groups_and_seeds(tiny_policy_dir, prompts_dir, tmp_path):
    from rlpipe.stages.rollout.core import group_seed

    cfg = config(tiny_policy_dir, prompts_dir, tmp_path / "r", num_prompts=5, prompt_offset=10,
                 iteration=3, policy_version=2, run="demo", seed=7, max_new_tokens=4)
    run(cfg)
    rows = read_table_artifact(cfg.output).to_pylist()
    prompts = read_table_artifact(prompts_dir).to_pylist()
    assert [r["prompt_id"] for r in rows[::4]] == ["p010", "p011", "p000", "p001", "p002"]
    for r in rows:
        p = prompts[(10 + r["group_id"]) % 12]
        assert (r["prompt"], r["answer"]) == (p["prompt"], p["answer"])
        assert r["seed"] == group_seed(7, 3, r["group_id"])
        assert (r["run"], r["iteration"], r["policy_version"]) == ("demo", 3, 2)


def test_same_seed_same_hash_and_cache_hit(tiny_policy_dir, prompts_dir, tmp_path, monkeypatch):
    a = run(config(tiny_policy_dir, prompts_dir, tmp_path / "a"))
    b = run(config(tiny_policy_dir, prompts_dir, tmp_path / "b"))
    c = run(config(tiny_policy_dir, prompts_dir, tmp_path / "c", seed=1))
    assert a.content_hash == b.content_hash != c.content_hash
    # a rerun with the same config and inputs is a cache hit: no engine is even built
    import rlpipe.stages.rollout.run as run_mod

    monkeypatch.setattr(run_mod, "get_engine", lambda name: pytest.fail("cache hit expected"))
    assert run(config(tiny_policy_dir, prompts_dir, tmp_path / "a")).content_hash == a.content_hash


def test_groups_do_not_depend_on_shard_size(tiny_policy_dir, prompts_dir, tmp_path):
    """With one prompt per batch, shards of 2 or of 12 groups give the same rows."""
    a = config(tiny_policy_dir, prompts_dir, tmp_path / "a", batch_size=1, groups_per_shard=2)
    b = config(tiny_policy_dir, prompts_dir, tmp_path / "b", batch_size=1, groups_per_shard=12)
    run(a), run(b)
    assert read_table_artifact(a.output).to_pylist() == read_table_artifact(b.output).to_pylist()


@pytest.mark.slow  # two fresh processes import torch + transformers (~15-75 s on 2 busy cores)
def test_two_worker_processes_equal_one(tiny_policy_dir, prompts_dir, tmp_path):
    one = config(tiny_policy_dir, prompts_dir, tmp_path / "one", groups_per_shard=3, batch_size=2)
    single = run(one)
    out = tmp_path / "two"
    args = [f"checkpoint={tiny_policy_dir}", f"prompts={prompts_dir}", f"output={out}",
            "groups_per_shard=3", "batch_size=2", "worker_count=2"]
    args += [f"{k}={v}" for k, v in SAMPLING.items()]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "rlpipe.stages.rollout", *args, f"worker_index={i}"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    merged = read_manifest(out)
    assert merged.shard_names == single.shard_names == [f"part-{k:05d}.parquet" for k in range(4)]
    assert read_table_artifact(out).to_pylist() == read_table_artifact(one.output).to_pylist()
    assert merged.content_hash == single.content_hash
    assert not list(out.glob(".worker-*"))  # markers removed by the committing worker


def test_errors_are_clear(tiny_policy_dir, prompts_dir, tmp_path):
    from rlpipe.schemas import PROMPTS, UserError, write_table_artifact

    empty = tmp_path / "empty"
    write_table_artifact(empty, PROMPTS, {"prompt_id": [], "prompt": [], "answer": [], "metadata": [],
                                          "messages": []}, stage="test")
    with pytest.raises(ValueError, match="has no rows"):
        run(config(tiny_policy_dir, empty, tmp_path / "o1"))

    long = tmp_path / "long"
    write_table_artifact(long, PROMPTS, {"prompt_id": ["short", "huge"], "prompt": ["Q: 1+1=", "1 " * 300],
                                         "answer": [None, None], "metadata": [None, None],
                                         "messages": [None, None]}, stage="test")
    before = run(config(tiny_policy_dir, prompts_dir, tmp_path / "o2", max_new_tokens=2))
    with pytest.raises(ValueError, match=r"prompt 'huge' .* too long: \d+ tokens .* context of 256"):
        run(config(tiny_policy_dir, long, tmp_path / "o2"))
    # bad inputs are found before the old artifact in the output directory is touched
    assert read_manifest(tmp_path / "o2").content_hash == before.content_hash

    with pytest.raises(UserError, match="checkpoint: .*nope does not exist"):
        run(config(tmp_path / "nope", prompts_dir, tmp_path / "o3"))

    with pytest.raises(ConfigError, match="engine"):
        load_config(RolloutConfig, overrides=[f"checkpoint={tiny_policy_dir}", f"prompts={prompts_dir}",
                                              "output=x", "engine=sglang"])
    with pytest.raises(ConfigError, match="worker_index 2 must be < worker_count 2"):
        load_config(RolloutConfig, overrides=["checkpoint=a", "prompts=b", "output=c",
                                              "worker_index=2", "worker_count=2"])

    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="make vllm-env"):  # a user error: exit 2, no traceback
            run(config(tiny_policy_dir, prompts_dir, tmp_path / "o4", engine="vllm"))


def test_temperature_zero_is_greedy(tiny_policy_dir, prompts_dir, tmp_path):
    """T=0 takes the argmax: the G samples of a group coincide, and each token is the policy's mode."""
    import torch

    from rlpipe.stages.common.models import load_model

    cfg = config(tiny_policy_dir, prompts_dir, tmp_path / "r", temperature=0.0, num_prompts=3, max_new_tokens=5)
    run(cfg)
    rows = read_table_artifact(cfg.output).to_pylist()
    model, _ = load_model(tiny_policy_dir)
    for g in range(3):
        group = [r for r in rows if r["group_id"] == g]
        assert len({tuple(r["response_token_ids"]) for r in group}) == 1
        seq = torch.tensor([group[0]["prompt_token_ids"] + group[0]["response_token_ids"]])
        with torch.no_grad():
            logits = model(input_ids=seq).logits[0]
        P, T = len(group[0]["prompt_token_ids"]), len(group[0]["response_token_ids"])
        assert logits[P - 1 : P - 1 + T].argmax(-1).tolist() == group[0]["response_token_ids"]


@pytest.mark.memory
def test_a_bf16_rollout_samples_from_the_bf16_model(tiny_policy_dir, prompts_dir, tmp_path):
    """`dtype: bf16` (a preset's `model.dtype`): the engine's model computes in bf16, and the
    recorded log-probs are the bf16 model's: off the fp32 model's by more than fp32 rounding
    allows, and within what bf16 rounding allows (u = 2^-8 per rounding; the weights, the 2
    layers' residual outputs and the logits z rounded: |dz| <= 6u max|z|, |dlogp| <= 2 max|dz|;
    fp32 the same with u = 2^-24)."""
    import numpy as np
    import torch

    from rlpipe.stages.common.forward import teacher_forced_logprobs
    from rlpipe.stages.common.models import MODELS, load_model

    cfg = config(tiny_policy_dir, prompts_dir, tmp_path / "r", batch_size=12, dtype="bf16")
    run(cfg)
    assert {p.dtype for p in MODELS.slots["rollout"].model.parameters()} == {torch.bfloat16}
    rows = read_table_artifact(cfg.output).to_pylist()
    prompts, responses = [r["prompt_token_ids"] for r in rows], [r["response_token_ids"] for r in rows]
    recorded = [np.asarray(r["response_logprobs"], dtype=np.float32) for r in rows]
    fp32_model = load_model(tiny_policy_dir)[0]
    fp32 = teacher_forced_logprobs(fp32_model, prompts, responses, 0)
    with torch.no_grad():
        z = max(float(fp32_model(input_ids=torch.tensor([p + r])).logits.abs().max())
                for p, r in zip(prompts, responses, strict=True))
    off = max(float(np.abs(a - b).max()) for a, b in zip(recorded, fp32, strict=True))
    assert 2 * 6 * 2**-24 * z < off <= 2 * 6 * 2**-8 * z, (off, z)
