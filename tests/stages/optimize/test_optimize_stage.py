"""The optimisation stage end to end on a tiny model and synthetic rollouts/advantages artifacts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlpipe.schemas import read_manifest, read_table_artifact, validate_artifact
from rlpipe.schemas.errors import UserError
from rlpipe.stages.advantage.kl import kl
from rlpipe.stages.common.forward import teacher_forced_logprobs
from rlpipe.stages.common.models import load_model
from rlpipe.stages.common.tiny import load_checkpoint
from rlpipe.stages.optimize.config import GSPOLoss
from rlpipe.stages.optimize.core import epoch_order
from rlpipe.stages.optimize.run import run


def _seq_logps(model, arts, pad_id):
    t = read_table_artifact(arts["rollouts"], "rollouts").to_pydict()
    lp = teacher_forced_logprobs(model, t["prompt_token_ids"], t["response_token_ids"], pad_id)
    return np.array([x.sum() for x in lp]), np.array(t["sample_index"]), t


def test_ppo_clip_first_step_ratio_is_one_and_moves_logprobs_by_advantage_sign(tmp_path, artifacts, tiny_policy_dir, make_config, read_metrics):
    cfg = make_config(tmp_path, artifacts, tiny_policy_dir, lr=3e-3, epochs=2, minibatch_size=8,
                          micro_batch_size=4)
    run(cfg)
    m = read_metrics(cfg.metrics_output)
    # first step of the first epoch: same model, same packing, no dropout -> rho == 1 exactly
    assert m[1]["ratio_min"] == 1.0 and m[1]["ratio_max"] == 1.0
    assert m[1]["clip_fraction"] == 0.0 and m[1]["approx_kl"] == 0.0
    assert m[0]["steps"] == 4 and m[4]["epoch"] == 1.0
    assert m[4]["approx_kl"] > 0.0 and m[4]["ratio_max"] > 1.0

    old, tok = load_checkpoint(tiny_policy_dir)
    new, _ = load_checkpoint(cfg.output)
    before, sample_index, rows = _seq_logps(old, artifacts, tok.pad_token_id)
    after, _, _ = _seq_logps(new, artifacts, tok.pad_token_id)
    positive = sample_index % 2 == 0  # the synthetic advantage is +1 for even samples, -1 for odd
    delta = after - before
    assert (delta[positive] > 0).all(), delta[positive]
    assert (delta[~positive] < 0).all(), delta[~positive]

    # the logged gap: rollout log-probs vs the trainer's recomputed ones (= the old policy's)
    old_lp = teacher_forced_logprobs(old, rows["prompt_token_ids"], rows["response_token_ids"], tok.pad_token_id)
    gap = np.concatenate([np.abs(np.array(r, np.float32) - o) for r, o in zip(rows["response_logprobs"], old_lp, strict=True)])
    assert m[0]["logprob_gap_mean_abs"] == pytest.approx(float(gap.mean()), abs=1e-5)
    assert m[0]["response_length_max"] == max(len(r) for r in rows["response_token_ids"])


def test_checkpoint_reloads_generates_and_is_remembered(tmp_path, artifacts, tiny_policy_dir, make_config, read_metrics):
    cfg = make_config(tmp_path, artifacts, tiny_policy_dir, minibatch_size=16, micro_batch_size=8)
    manifest = run(cfg)
    assert validate_artifact(cfg.output) == [] and validate_artifact(cfg.metrics_output) == []
    assert manifest.kind == "checkpoint" and manifest.inputs["advantages"].schema_name == "advantages"
    names = {f.name for f in manifest.files}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= names
    # the manifest is written last: no file is newer
    newest = max((cfg.output / n).stat().st_mtime_ns for n in names)
    assert (cfg.output / "_manifest.json").stat().st_mtime_ns >= newest

    disk, tok = load_checkpoint(cfg.output)
    ids = tok("Q: 3+4= A:", return_tensors="pt")
    out = disk.generate(**ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]
    # the in-process cache now serves exactly the saved weights, in eval mode
    cached, _ = load_model(cfg.output)
    assert not cached.training
    for (k, a), (_, b) in zip(disk.state_dict().items(), cached.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    trained = dict(disk.named_parameters())
    start, _ = load_checkpoint(tiny_policy_dir)
    assert any(not torch.equal(p, trained[k]) for k, p in start.named_parameters())


def test_rerun_is_a_cache_hit_and_the_result_is_deterministic(tmp_path, artifacts, tiny_policy_dir, make_config, read_metrics):
    a = make_config(tmp_path, artifacts, tiny_policy_dir, "a", minibatch_size=8, micro_batch_size=4)
    first = run(a)
    again = run(a)
    assert again.created_at == first.created_at and again.content_hash == first.content_hash
    b = make_config(tmp_path, artifacts, tiny_policy_dir, "b", minibatch_size=8, micro_batch_size=4)
    second = run(b)
    assert second.content_hash == first.content_hash
    assert read_manifest(b.metrics_output).content_hash == read_manifest(a.metrics_output).content_hash
    forced = run(a, force=True)
    assert forced.content_hash == first.content_hash and forced.created_at >= first.created_at


def test_gspo_with_kl_in_loss_and_entropy_bonus(tmp_path, tiny_tokenizer, tiny_policy_dir, build, make_config, read_metrics):
    arts = build(tmp_path, tiny_tokenizer, with_ref=True)
    cfg = make_config(tmp_path, arts, tiny_policy_dir, loss="gspo",
                          kl_beta=0.1, kl_estimator="k3", entropy_coef=0.01, minibatch_size=8, micro_batch_size=2,
                          agg_mode="seq-mean-token-mean")
    assert cfg.loss == GSPOLoss(eps_low=3e-4, eps_high=4e-4)  # GSPO's own clip range, not PPO's 0.2
    run(cfg)
    m = read_metrics(cfg.metrics_output)
    assert m[1]["ratio_min"] == 1.0 and m[1]["clip_fraction"] == 0.0
    # at step 1 the logged KL to the reference is the mean k3 of the start policy against the
    # advantages' ref_logprobs (joined on the key) over the first minibatch's tokens
    old, tok = load_checkpoint(tiny_policy_dir)
    ro = read_table_artifact(arts["rollouts"], "rollouts").to_pydict()
    adv = read_table_artifact(arts["advantages"], "advantages").to_pydict()
    ref_by_key = {(g, s): r for g, s, r in zip(adv["group_id"], adv["sample_index"], adv["ref_logprobs"], strict=True)}
    rows = epoch_order(16, cfg.seed, 0)[:8]
    lp = teacher_forced_logprobs(old, [ro["prompt_token_ids"][i] for i in rows],
                                 [ro["response_token_ids"][i] for i in rows], tok.pad_token_id)
    ref = [np.array(ref_by_key[(ro["group_id"][i], ro["sample_index"][i])], np.float32) for i in rows]
    k3 = np.concatenate([kl("k3", torch.from_numpy(a), torch.from_numpy(b)).numpy() for a, b in zip(lp, ref, strict=True)])
    assert m[1]["kl_ref"] == pytest.approx(float(k3.mean()), rel=1e-4)
    # the loss includes + beta * agg(k3) - c_H * agg(H): with rho == 1 and seq-mean-token-mean, the
    # policy term is -mean_seq(A); loss - policy_loss is the regularisers' share
    assert m[1]["loss"] != pytest.approx(m[1]["policy_loss"])
    assert m[2]["clip_fraction"] > 0.0  # GSPO's tiny clip range bites after one update


def test_ppo_critic_value_loss_decreases(tmp_path, tiny_tokenizer, tiny_policy_dir, build, make_config, read_metrics):
    arts = build(tmp_path, tiny_tokenizer, with_values=True)
    cfg = make_config(tmp_path, arts, tiny_policy_dir, critic=tiny_policy_dir, critic_output=tmp_path / "critic",
                          critic_lr=3e-3, epochs=8, minibatch_size=16, micro_batch_size=8, value_clip=None)
    run(cfg)
    m = read_metrics(cfg.metrics_output)
    losses = [m[s]["value_loss"] for s in range(1, 9)]
    assert losses[-1] < 0.5 * losses[0], losses
    assert m[8]["explained_variance"] > m[1]["explained_variance"]
    assert validate_artifact(cfg.critic_output) == []
    trained, _ = load_model(cfg.critic_output, "critic")  # the copy the stage kept in memory
    critic, _ = load_model(cfg.critic_output, "critic", cache=False)  # what the files hold
    assert type(critic).__name__ == "ScalarHeadModel" and critic.kind == "critic"
    assert trained.state_dict().keys() == critic.state_dict().keys()
    assert all(torch.equal(v, critic.state_dict()[k]) for k, v in trained.state_dict().items())


def test_bad_inputs_are_named(tmp_path, tiny_tokenizer, tiny_policy_dir, build, make_config, read_metrics):
    arts = build(tmp_path, tiny_tokenizer)
    with pytest.raises(ValueError, match="ref_logprobs"):
        run(make_config(tmp_path, arts, tiny_policy_dir, kl_beta=0.1))
    other = build(tmp_path / "other", tiny_tokenizer, groups=3)
    with pytest.raises(ValueError, match="rows of the advantages .* are missing"):
        run(make_config(tmp_path, {"rollouts": other["rollouts"], "advantages": arts["advantages"]},
                            tiny_policy_dir))
    with pytest.raises(UserError, match="rows 16, minibatch_size 12.*set optimize.minibatch_size"):
        run(make_config(tmp_path, arts, tiny_policy_dir, minibatch_size=12, micro_batch_size=4))
    with pytest.raises(ValueError, match="critic_output"):
        make_config(tmp_path, arts, tiny_policy_dir, critic=tiny_policy_dir)


def test_cli_runs_from_yaml_and_accepts_the_deepspeed_launchers_local_rank(tmp_path, artifacts, tiny_policy_dir,
                                                                          make_config, read_metrics):
    import yaml

    from rlpipe.stages.optimize.__main__ import main

    cfg = make_config(tmp_path, artifacts, tiny_policy_dir, "cli", minibatch_size=16, micro_batch_size=16)
    path = tmp_path / "optimize.yaml"
    path.write_text(yaml.safe_dump(cfg.resolved()))
    assert main(["-c", str(path), "--local_rank=0", "epochs=2"]) == 0
    m = read_metrics(cfg.metrics_output)
    assert m[0]["steps"] == 2.0 and read_manifest(cfg.output).config["epochs"] == 2
    assert main(["-c", str(path), "loss=nope"]) == 2  # config errors answer before any work


@pytest.mark.gpu
def test_bf16_on_cuda(tmp_path, artifacts, tiny_policy_dir, make_config, read_metrics):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from safetensors.torch import load_file

    from rlpipe.stages.common.deepspeed import ds_config
    from rlpipe.stages.optimize import engine as E

    # the whole batch (16 rows) in step 1, so its loss is known from the data alone; 2 epochs
    common = dict(minibatch_size=16, micro_batch_size=4, epochs=2, lr=1e-3)
    cfg = make_config(tmp_path, artifacts, tiny_policy_dir, "bf16", dtype="auto", **common)
    ref = make_config(tmp_path, artifacts, tiny_policy_dir, "fp32", dtype="fp32", **common)
    run(cfg)
    run(ref)
    m, m32 = read_metrics(cfg.metrics_output), read_metrics(ref.metrics_output)
    assert m[0]["steps"] == 2.0
    assert m[1]["ratio_min"] == 1.0 and m[1]["ratio_max"] == 1.0  # old log-probs recomputed in bf16 too
    # step 1 at ratio 1: policy_loss = -token-mean(A), whatever the precision (A = +-1 per row)
    adv = read_table_artifact(artifacts["advantages"], "advantages").column("token_advantages").to_pylist()
    assert m[1]["policy_loss"] == pytest.approx(-sum(map(sum, adv)) / sum(map(len, adv)), abs=1e-6)
    for step in (1, 2):
        for name in ("loss", "grad_norm", "approx_kl", "entropy"):
            assert np.isfinite(m[step][name]), (step, name)
        assert m[step]["grad_norm"] > 0
    # bf16 keeps 8 mantissa bits (u = 2^-9 ~ 2e-3 per rounding); the gradient norm of this 2-layer
    # model passes through a few dozen roundings of weights and activations: within 5% of fp32.
    assert m[1]["grad_norm"] == pytest.approx(m32[1]["grad_norm"], rel=5e-2)
    assert m[2]["approx_kl"] > 0  # step 2 is off-policy: the policy moved
    start = load_file(tiny_policy_dir / "model.safetensors")
    trained = load_file(cfg.output / "model.safetensors")
    for name, w in start.items():
        assert "norm" in name or not torch.equal(trained[name].float(), w.float()), f"{name} did not move"

    # DeepSpeed's bf16 engine: the module computes in bf16, the optimizer updates fp32 master weights
    # (an lr 1e-6 update would vanish below bf16's ulp otherwise).
    policy, _ = load_model(tiny_policy_dir, cache=False)
    engine = E.make_engine(policy, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), gradient_checkpointing=False,
                           config=ds_config(0, micro_batch_size=4, grad_accum=1, world_size=1, grad_clip=1.0,
                                              bf16=True))
    try:
        assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
        master = [p for g in engine.optimizer.optimizer.param_groups for p in g["params"]]
        assert master and {p.dtype for p in master} == {torch.float32}
    finally:
        engine.destroy()


def test_early_stop_on_approx_kl_target(tmp_path, artifacts, tiny_policy_dir, make_config, read_metrics):
    cfg = make_config(tmp_path, artifacts, tiny_policy_dir, lr=3e-3, epochs=3, minibatch_size=8,
                      micro_batch_size=8, kl_target=1e-9)
    run(cfg)
    m = read_metrics(cfg.metrics_output)
    # step 1 has approx KL 0 (rho == 1); step 2 exceeds the target and is the last
    assert m[0]["steps"] == 2.0 and m[0]["early_stopped"] == 1.0 and 3 not in m
    assert m[2]["approx_kl"] > 1e-9


def test_gradient_checkpointing_and_zero1_give_the_same_update(tmp_path, artifacts, tiny_policy_dir, make_config,
                                                              read_metrics):
    from safetensors.torch import load_file

    outs = {}
    for name, kw in {"plain": {}, "ckpt": {"gradient_checkpointing": True}, "zero1": {"zero_stage": 1}}.items():
        cfg = make_config(tmp_path, artifacts, tiny_policy_dir, name, minibatch_size=8, micro_batch_size=4, **kw)
        run(cfg)
        outs[name] = load_file(cfg.output / "model.safetensors")
        assert read_metrics(cfg.metrics_output)[1]["ratio_max"] == 1.0
    for name in ("ckpt", "zero1"):
        for k, v in outs["plain"].items():
            assert (outs[name][k] - v).abs().max().item() <= 1e-5, (name, k)


@pytest.mark.multiturn
@pytest.mark.parametrize("old", [{"recompute_old_logprobs": False}, {"tis_cap": 2.0, "mismatch_mask": 3.0}])
def test_the_environments_tokens_carry_no_gradient(tmp_path, tiny_tokenizer, tiny_policy_dir, build, make_config, old):
    """Episodes: every per-token number on the tokens the environment wrote (behaviour, old and
    reference log-probs, advantages) can be anything: the update is the same to the bit. The
    same numbers on sampled tokens do change it (the check can fail)."""
    from safetensors.torch import load_file

    knobs = dict(kl_beta=0.1, entropy_coef=0.01, epochs=2, minibatch_size=8, micro_batch_size=4, **old)

    def update(name: str, **build_knobs) -> dict:
        arts = build(tmp_path / name, tiny_tokenizer, with_ref=True, **build_knobs)
        run(make_config(tmp_path, arts, tiny_policy_dir, name=name, **knobs))
        return load_file(tmp_path / f"{name}_policy" / "model.safetensors")

    clean, garbage = update("clean", environment=0.0), update("garbage", environment=37.5)
    assert clean.keys() == garbage.keys() and all(torch.equal(clean[k], garbage[k]) for k in clean)
    other = update("other", environment=0.0, seed=1)  # other sampled tokens and numbers: another update
    assert any(not torch.equal(clean[k], other[k]) for k in clean)
