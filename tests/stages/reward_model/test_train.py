"""The reward-model stage end to end: DeepSpeed on CPU (gloo, fp32), synthetic preferences."""

import polars as pl
import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file

from rlpipe.schemas import (
    PREFERENCES,
    read_manifest,
    read_table_artifact,
    validate_artifact,
    write_table_artifact,
)
from rlpipe.schemas.errors import UserError
from rlpipe.stages.common.models import load_model
from rlpipe.stages.preferences.synthetic import synthetic_preferences, write_synthetic_preferences
from rlpipe.stages.reward_model import engine
from rlpipe.stages.reward_model.__main__ import main
from rlpipe.stages.reward_model.config import RewardModelConfig
from rlpipe.stages.reward_model.core import split_pairs
from rlpipe.stages.reward_model.modeling import (
    check_reward_checkpoint,
    score_texts,
)
from rlpipe.stages.reward_model.run import run


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefs") / "preferences"
    write_synthetic_preferences(path, 256, kind="keyword", seed=0, rows_per_shard=100)
    return path


@pytest.fixture(scope="module")
def small_prefs(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefs") / "small"
    write_synthetic_preferences(path, 40, kind="keyword", seed=1)
    return path


def _config(prefs, base, out, **kw):
    defaults = dict(preferences=prefs, base=base, output=out, eval_fraction=0.25, epochs=2, batch_size=16,
                    lr=1e-3, seed=0)
    return RewardModelConfig(**{**defaults, **kw})


def _weights(checkpoint):
    """Backbone and head tensors of a reward checkpoint (model.safetensors + scalar_head.safetensors)."""
    head = {f"head.{k}": v for k, v in load_file(checkpoint / "scalar_head.safetensors").items()}
    return load_file(checkpoint / "model.safetensors") | head


def test_learns_synthetic_preferences(prefs, tiny_policy_dir, tmp_path, monkeypatch):
    cfg = _config(prefs, tiny_policy_dir, tmp_path / "rm")
    manifest = run(cfg)
    assert manifest.kind == "checkpoint" and manifest.stage == "reward_model"
    check_reward_checkpoint(cfg.output)
    assert validate_artifact(tmp_path / "rm_metrics") == []
    m = pl.from_arrow(read_table_artifact(tmp_path / "rm_metrics"))
    loss = m.filter(pl.col("name") == "loss").sort("step")["value"].to_list()
    assert len(loss) == 2 * 192 // 16  # one row per optimizer step
    assert loss[-1] < 0.5 * loss[0]
    acc = m.filter(pl.col("name") == "eval_accuracy").sort("step")["value"].to_list()
    assert acc[-1] >= 0.9
    assert manifest.extra["eval_accuracy"] == acc[-1]
    assert manifest.extra["eval_pairs"] == 64

    # The saved checkpoint is the trained model: recomputing held-out accuracy from disk agrees.
    table = synthetic_preferences(256, kind="keyword", seed=0)
    _, held = split_pairs(table.column("pair_id").to_pylist(), 0.25, 0)
    rows = table.take(held).to_pydict()
    model, tok = load_model(cfg.output, "reward", cache=False)
    r_c = score_texts(model, tok, rows["prompt"], rows["chosen"], max_length=512, batch_size=64)
    r_r = score_texts(model, tok, rows["prompt"], rows["rejected"], max_length=512, batch_size=64)
    assert float((r_c > r_r).float().mean()) == pytest.approx(acc[-1])

    # Same config and inputs: a cache hit, no training.
    monkeypatch.setattr(engine, "train", lambda *a, **k: pytest.fail("trained on a cache hit"))
    assert run(cfg).content_hash == manifest.content_hash


@pytest.mark.slow
def test_zero3_matches_zero0_and_reruns_are_identical(small_prefs, tiny_policy_dir, tmp_path):
    small = dict(epochs=1, batch_size=4, gradient_accumulation=2, max_length=32, eval_fraction=0.2)
    z0 = run(_config(small_prefs, tiny_policy_dir, tmp_path / "z0", **small))
    z0_again = run(_config(small_prefs, tiny_policy_dir, tmp_path / "z0", **small), force=True)
    assert z0_again.content_hash == z0.content_hash  # same seed + inputs -> same bytes
    run(_config(small_prefs, tiny_policy_dir, tmp_path / "z3", zero_stage=3, **small))
    w0, w3 = _weights(tmp_path / "z0"), _weights(tmp_path / "z3")
    assert w0.keys() == w3.keys()
    base = load_file(tiny_policy_dir / "model.safetensors")
    emb = "embed_tokens.weight"  # the reward model's backbone is saved on its own (scalar_head.py)
    assert not torch.allclose(w0[emb], base["model." + emb])  # it trained
    # ZeRO-3 computes the same gradients in another summation order (partitioned flat buffers,
    # its own linear backward), so a gradient g differs by dg ~ u * G, u = 2^-24 the fp32 unit
    # roundoff and G ~ 2e-2 the largest |gradient| of this model and data (measured). AdamW's
    # first update is lr * g / (|g| + eps): its slope in g is eps / (|g| + eps)^2 <= 1 / eps, so
    # the few elements whose gradient is ~eps = 1e-8 (cancelling sums: measured 1.2e-8 at the
    # worst element, against 1e-2 elsewhere) move by up to lr * u * G / eps = 1e-3 * 6e-8 * 2e-2
    # / 1e-8 = 1.2e-4 differently (measured 4.9e-6 here, 1.86e-5 on another machine). Later steps
    # are less sensitive (v holds the earlier squared gradients), so that is the bound per element.
    adam_eps, unit_roundoff, grad_scale, lr = 1e-8, 2.0**-24, 2e-2, 1e-3
    atol = lr * unit_roundoff * grad_scale / adam_eps
    for k in w0:
        torch.testing.assert_close(w3[k], w0[k], atol=atol, rtol=0)
    # Few elements are that ill-conditioned; the rest agree to ~1 ulp. So the function the two
    # models compute agrees far more tightly: every logged loss, accuracy and held-out reward
    # statistic (O(1) averages) within 1e-6 (measured <= 1e-7).
    m0 = pl.from_arrow(read_table_artifact(tmp_path / "z0_metrics")).sort("step", "name")
    m3 = pl.from_arrow(read_table_artifact(tmp_path / "z3_metrics")).sort("step", "name")
    assert m3["name"].to_list() == m0["name"].to_list() and "eval_reward_mean" in m0["name"].to_list()
    assert m3["value"].to_list() == pytest.approx(m0["value"].to_list(), rel=0, abs=1e-6)


def test_cli_and_bad_inputs(prefs, small_prefs, tiny_policy_dir, tiny_reward_dir, tmp_path, capsys):
    assert main(["--print-config", f"preferences={prefs}", f"base={tiny_policy_dir}", f"output={tmp_path}/o"]) == 0
    assert "zero_stage: 0" in capsys.readouterr().out
    assert main([f"preferences={prefs}", f"base={tiny_policy_dir}", "zero_stage=4"]) == 2  # invalid config
    with pytest.raises(UserError, match="base: .*missing does not exist"):
        run(_config(prefs, tmp_path / "missing", tmp_path / "o"))
    # a reward-model base is accepted as is (its head is kept)
    cfg = _config(small_prefs, tiny_reward_dir, tmp_path / "from_rm", epochs=1, eval_fraction=0.1, lr=1e-9)
    run(cfg)
    assert read_manifest(cfg.output).inputs["base"].path == str(tiny_reward_dir)
    w = load_file(cfg.output / "scalar_head.safetensors")["weight"]
    torch.testing.assert_close(w, load_file(tiny_reward_dir / "scalar_head.safetensors")["weight"], atol=1e-6, rtol=0)


@pytest.mark.integration
@pytest.mark.slow
def test_two_ranks_match_one(small_prefs, tiny_policy_dir, tmp_path):
    """torchrun, 2 CPU ranks x 4 pairs == 1 rank x 8 pairs (32 training pairs: 4 full steps)."""
    import os
    import socket
    import subprocess

    import yaml

    from rlpipe.cluster.launch import local_env, stage_command, torchrun_executable

    common = dict(epochs=1, eval_fraction=0.2, max_length=32, zero_stage=2)
    two = _config(small_prefs, tiny_policy_dir, tmp_path / "two", batch_size=4, **common)
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(two.model_dump(mode="json")))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = stage_command("reward_model", ["-c", str(tmp_path / "two.yaml")], nproc_per_node=2, master_port=port)
    proc = subprocess.Popen([torchrun_executable(), *cmd[1:]], env=local_env(threads_per_rank=1),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=os.getcwd())
    one = run(_config(small_prefs, tiny_policy_dir, tmp_path / "one", batch_size=8, **common))
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert read_manifest(two.output).extra["world_size"] == 2 and one.extra["world_size"] == 1
    w1, w2 = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    # gradients agree to ~1e-7 (reduction order); Adam's m / sqrt(v) can magnify that on the few
    # embedding rows whose gradients are themselves ~1e-6, hence 1e-4 on 4 steps at lr 1e-3
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-4, rtol=1e-3)
    m1 = pl.from_arrow(read_table_artifact(tmp_path / "one_metrics")).sort("step", "name")
    m2 = pl.from_arrow(read_table_artifact(tmp_path / "two_metrics")).sort("step", "name")
    assert m1["name"].to_list() == m2["name"].to_list() and m1["step"].max() == 4
    assert m2["value"].to_list() == pytest.approx(m1["value"].to_list(), rel=1e-4, abs=1e-5)


def test_margin_column_enters_the_loss(tiny_reward_dir, tmp_path):
    """With lr ~ 0 the held-out loss is the BT loss of the base model's rewards, margin included."""
    table = synthetic_preferences(24, kind="keyword", seed=2)
    table = table.set_column(4, "margin", pa.array([1.5] * 24, pa.float32()))
    write_table_artifact(tmp_path / "prefs", PREFERENCES, table, stage="test")
    _, held = split_pairs(table.column("pair_id").to_pylist(), 0.25, 0)
    rows = table.take(held).to_pydict()
    model, tok = load_model(tiny_reward_dir, "reward")
    diff = (score_texts(model, tok, rows["prompt"], rows["chosen"], max_length=512, batch_size=64)
            - score_texts(model, tok, rows["prompt"], rows["rejected"], max_length=512, batch_size=64))
    for use_margin, m in ((True, 1.5), (False, 0.0)):
        out = tmp_path / f"rm_{use_margin}"
        run(_config(tmp_path / "prefs", tiny_reward_dir, out, epochs=1, lr=1e-12, use_margin=use_margin))
        got = read_manifest(out).extra["eval_loss"]
        # L = -mean log sigmoid(r_c - r_r - m)
        assert got == pytest.approx(float(-torch.nn.functional.logsigmoid(diff - m).mean()), abs=1e-5)
