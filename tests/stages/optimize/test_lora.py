"""LoRA for the policy (stages/optimize/lora.py): optimize trains only the adapters, the checkpoint
holds the merged weights and the adapter, the reference is the base with the adapters disabled,
the train state carries the adapters across iterations, and the LoRA demo learns."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rlpipe.stages.optimize.run import clear_warm, run

pytest.importorskip("peft")

LORA = {"r": 4, "alpha": 8.0}
EPS32 = torch.finfo(torch.float32).eps


def _logits(model, tokenizer, texts=("Q: 12+7= A: 19", "Q: 3+4= A:")) -> torch.Tensor:
    enc = tokenizer(list(texts), return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits


def _peft_policy(base_dir, adapter_dir):
    """The base checkpoint with the saved adapter, through peft's own loader."""
    from peft import PeftModel

    from rlpipe.stages.common.tiny import load_checkpoint

    base, tok = load_checkpoint(base_dir, "causal")
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval(), tok


def _helpers():
    """This folder's conftest (its artifact and config builders) as a module: a module-scoped
    fixture cannot take the function-scoped `build` / `make_config` fixtures."""
    spec = importlib.util.spec_from_file_location("optimize_helpers", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_tokenizer, tiny_policy_dir):
    """One LoRA optimize run (2 epochs: B starts at 0, so A moves from the second step on), KL to
    the base in the loss with no reference artifact."""
    build_artifacts, optimize_config = _helpers().build_artifacts, _helpers().optimize_config
    root = tmp_path_factory.mktemp("lora")
    arts = build_artifacts(root, tiny_tokenizer)
    cfg = optimize_config(root, arts, tiny_policy_dir, lora=LORA, epochs=2, kl_beta=0.1,
                          train_state_output=root / "state")
    manifest = run(cfg)
    clear_warm()
    return cfg, manifest


def test_only_the_adapters_train(trained, tiny_policy_dir):
    from rlpipe.stages.common.tiny import load_checkpoint
    from rlpipe.stages.optimize.lora import wrap
    from rlpipe.stages.optimize.state import master_weights

    cfg, manifest = trained
    base = load_file(tiny_policy_dir / "model.safetensors")
    # The train state's module: the frozen base weights bit for bit, beside the adapters.
    module = master_weights(cfg.train_state_output)
    frozen = {k.replace("base_model.model.", "").replace(".base_layer.", "."): v
              for k, v in module.items() if ".lora_" not in k}
    assert set(base) <= set(frozen)
    for name, w in base.items():
        assert torch.equal(frozen[name], w), name
    # The adapters moved: B from its zero init, A from its seeded init.
    adapter = load_file(cfg.output / "adapter" / "adapter_model.safetensors")
    initial = wrap(load_checkpoint(tiny_policy_dir, "causal")[0], **LORA, target_modules="all-linear", seed=cfg.seed)
    init = {k.replace(".default", ""): v for k, v in initial.state_dict().items() if ".lora_" in k}
    assert set(adapter) == set(init) and len(adapter) == 2 * 7 * 2  # A and B, 7 linear layers x 2 blocks
    for name, w in adapter.items():
        assert not torch.equal(w, init[name]), f"{name} did not train"
    # Every base weight outside the adapted layers is unchanged in the merged checkpoint too.
    merged = load_file(cfg.output / "model.safetensors")
    adapted = {k.split(".lora_")[0].replace("base_model.model.", "") + ".weight" for k in adapter}
    for name, w in base.items():
        assert torch.equal(merged[name], w) == (name not in adapted), name
    # The manifest records the adapter, its parameter counts and the base it sits on.
    record = manifest.extra["lora"]
    assert record["adapter"] == "adapter" and record["r"] == 4 and record["alpha"] == 8.0
    assert record["trainable_parameters"] == sum(v.numel() for v in adapter.values())
    assert record["total_parameters"] == record["trainable_parameters"] + sum(
        v.numel() for k, v in base.items() if k != "lm_head.weight")  # the head is tied to the embedding
    assert record["base"]["path"] == str(tiny_policy_dir)
    assert json.loads((cfg.output / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] is None


def test_merged_checkpoint_equals_the_peft_model(trained, tiny_policy_dir):
    from rlpipe.stages.common.tiny import load_checkpoint
    from rlpipe.stages.optimize.lora import merged_state_dict

    cfg, _ = trained
    peft_model, tok = _peft_policy(tiny_policy_dir, cfg.output / "adapter")
    merged, _ = load_checkpoint(cfg.output, "causal")
    # The saved weights are peft's own merge (W + get_delta_weight), bit for bit.
    want = load_file(cfg.output / "model.safetensors")
    got = merged_state_dict(peft_model)
    for name, w in want.items():
        assert torch.equal(got[name], w), name
    # Logits: the merged model computes (W + s B A) x, peft W x + s B (A x): the same sums in
    # another order. An fp32 dot product of length n differs by ~sqrt(n) * eps relative (rounding
    # errors of random sign; n <= 128 here), and the difference passes through ~8 matmuls in
    # sequence (2 blocks x (attention, o, MLP) and the head), so logits of magnitude L differ by
    # ~8 * sqrt(128) * eps * L (measured: ~2 eps * L).
    a, b = _logits(peft_model, tok), _logits(merged, tok)
    tol = 8 * 128 ** 0.5 * EPS32 * float(a.abs().max())
    assert float((a - b).abs().max()) <= tol
    assert float((a - _logits(load_checkpoint(tiny_policy_dir, "causal")[0], tok)).abs().max()) > 100 * tol


def test_disabled_adapters_are_the_base_model_exactly(trained, tiny_policy_dir, read_metrics):
    from rlpipe.stages.common.tiny import load_checkpoint

    cfg, _ = trained
    peft_model, tok = _peft_policy(tiny_policy_dir, cfg.output / "adapter")
    base, _ = load_checkpoint(tiny_policy_dir, "causal")
    with peft_model.disable_adapter():
        assert torch.equal(_logits(peft_model, tok), _logits(base, tok))
    # The optimize run's reference was the base (adapters off): at step 1 the policy is the base
    # too (B = 0), so the KL to it is exactly 0; after one update it is not.
    metrics = read_metrics(cfg.metrics_output)
    assert metrics[1]["kl_ref"] == 0.0 and metrics[2]["kl_ref"] > 0.0


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_train_state_resume_equals_an_uninterrupted_run(tmp_path, tiny_tokenizer, tiny_policy_dir, build, make_config,
                                                       read_metrics, zero_stage):
    """Two iterations, the second continued from the first's train state: kept warm in memory
    (uninterrupted) or loaded from disk (a resume; the policy input is then the merged checkpoint,
    whose weights the state replaces by the base + adapters): the same adapters and weights, bit
    for bit. Without the state, the second iteration would start a new adapter: different.
    The KL to the reference (in the loss) is to the base, not to the previous iteration."""
    batches = [build(tmp_path / f"data{k}", tiny_tokenizer, seed=k, iteration=k) for k in range(2)]

    def chain(name: str, cold: bool, carry: bool = True):
        policy, state, out = tiny_policy_dir, None, None
        for k, arts in enumerate(batches):
            if cold:
                clear_warm()
            cfg = make_config(tmp_path, arts, policy, f"{name}{k}", lora=LORA, zero_stage=zero_stage, micro_batch_size=8,
                              kl_beta=0.1,
                              train_state=state if carry else None, train_state_output=tmp_path / f"{name}{k}_state")
            out = run(cfg)
            policy, state = cfg.output, cfg.train_state_output
        clear_warm()
        return policy, out

    warm, warm_manifest = chain("warm", cold=False)
    cold, cold_manifest = chain("cold", cold=True)
    fresh, _ = chain("fresh", cold=False, carry=False)
    for file in ("model.safetensors", "adapter/adapter_model.safetensors"):
        a, b, c = load_file(warm / file), load_file(cold / file), load_file(fresh / file)
        assert all(torch.equal(a[k], b[k]) for k in a), file
        assert any(not torch.equal(a[k], c[k]) for k in a), file
    assert warm_manifest.content_hash == cold_manifest.content_hash
    # The continued adapter still sits on the first iteration's input, not on its merged output.
    assert cold_manifest.extra["lora"]["base"]["path"] == str(tiny_policy_dir)
    assert json.loads((tmp_path / "cold1_state" / "topology.json").read_text())["global_steps"] == 2

    # Step 1 of the second iteration: the policy is the first iteration's (merged) output and the
    # reference the base, so kl_ref is the token mean of k3(logp_policy0, logp_base) over batch 1.
    # (A reference with the adapters on would give exactly 0.) Tolerance: both log-probs come from
    # other batch shapes and the merged rather than the peft form (fp32, ~1e-6 apart); k3's
    # derivative in logp is 1 - exp(-lr), |lr| <~ 0.1 here, so kl_ref agrees to ~1e-7 absolute.
    from rlpipe.stages.advantage.kl import kl
    from rlpipe.stages.common.forward import teacher_forced_logprobs
    from rlpipe.stages.common.tiny import load_checkpoint
    from rlpipe.stages.optimize.data import load_batch

    batch = load_batch(batches[1]["rollouts"], batches[1]["advantages"])

    def logprobs(checkpoint):
        model, tok = load_checkpoint(checkpoint, "causal")
        return torch.from_numpy(np.concatenate(teacher_forced_logprobs(model, batch.prompt_ids, batch.response_ids,
                                                                       tok.pad_token_id)))

    want = float(kl("k3", logprobs(tmp_path / "cold0_policy"), logprobs(tiny_policy_dir)).double().mean())
    got = read_metrics(tmp_path / "cold1_metrics")[1]["kl_ref"]
    assert want > 1e-5 and got == pytest.approx(want, abs=1e-7)


def test_lora_config_is_checked(tmp_path, artifacts, tiny_policy_dir, make_config, trained):
    from rlpipe.schemas.config_files import ConfigError, parse_config
    from rlpipe.stages.optimize.config import OptimizeConfig

    with pytest.raises(ValueError, match="ZeRO 3"):
        make_config(tmp_path, artifacts, tiny_policy_dir, lora=LORA, zero_stage=3)
    with pytest.raises(ConfigError, match="dropout"):
        parse_config(OptimizeConfig, {"policy": "p", "rollouts": "r", "advantages": "a", "output": "o",
                                      "metrics_output": "m", "lora": {"r": 4, "dropout": 0.1}})
    cfg = make_config(tmp_path, artifacts, tiny_policy_dir, lora={"target_modules": ["no_such_proj"]})
    with pytest.raises(ValueError, match="no_such_proj"):
        run(cfg)
    # A train state continues only the LoRA knobs it was saved with (here r 4, alpha 8).
    for lora in ({"r": 8, "alpha": 8.0}, None):
        cfg = make_config(tmp_path, artifacts, tiny_policy_dir, lora=lora, train_state=trained[0].train_state_output)
        with pytest.raises(ValueError, match="saved with optimize.lora"):
            run(cfg)
    clear_warm()


@pytest.mark.integration
@pytest.mark.slow
def test_lora_demo_learns(tmp_path, demo_setup):
    """The demo_lora preset, shortened: held-out greedy accuracy and reward rise with adapters only."""
    from rlpipe.pipelines.layout import RunLayout
    from rlpipe.pipelines.plan import Plan
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.pipelines.report import eval_metrics
    from rlpipe.pipelines.runner import Pipeline
    from rlpipe.schemas import read_manifest

    preset = load_preset("demo_lora", ["iterations=12", "eval_every=0"])
    assert Plan(preset, RunLayout(tmp_path / "x")).iteration(0)[-1].config.lora.r == 8
    run_dir = demo_setup(tmp_path / "demo")  # (the demo's set-up, made once for the session)
    records = Pipeline(preset, run_dir, log=lambda s: None).run()

    before = eval_metrics(run_dir / "eval_0000")["accuracy"]
    after = eval_metrics(run_dir / "iter_0011" / "eval")["accuracy"]
    assert after >= before + 0.1, f"held-out greedy accuracy {before:.2f} -> {after:.2f}"
    rewards = [r.metrics["reward_mean"] for r in records]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4, rewards
    record = read_manifest(run_dir / "iter_0011" / "policy").extra["lora"]
    assert record["base"]["path"] == str(run_dir / "models" / "sft")
    assert record["trainable_parameters"] < record["total_parameters"] / 5
