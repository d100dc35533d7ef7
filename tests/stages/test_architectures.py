"""Every stage on tiny random-init checkpoints of many causal-LM architectures (no download).

Per architecture, the stages run in process in pipeline order on one shared chain of module-scoped
fixtures: sft -> reward_model -> rollout (transformers engine) -> score (the reward model) ->
critic_init -> reference (with the critic) -> advantage (GAE) -> optimize (with the critic), each
on a few prompts and one step. Every test checks numbers against an independent forward pass.
GPT-2, GPT-NeoX and Bloom get a tokenizer without a pad token, as theirs ship (pad = eos).
"""

from __future__ import annotations

import copy
import json
import logging

import numpy as np
import pytest
import torch
from architectures import ARCHITECTURES, DROPOUT, ROPE, build_model
from safetensors.torch import load_file

from rlpipe.schemas import REFERENCE, ROLLOUTS, read_manifest, read_table_artifact
from rlpipe.stages import get_stage
from rlpipe.stages.common.forward import teacher_forced_logprobs
from rlpipe.stages.common.models import clear_cache, context_length, load_model
from rlpipe.stages.common.scalar_head import HEAD_FILE, ScalarHeadModel
from rlpipe.stages.common.tiny import load_checkpoint, load_tokenizer, save_pretrained
from rlpipe.stages.reward_model.modeling import check_reward_checkpoint, encode, score_texts

MATRIX = [pytest.mark.architectures, pytest.mark.slow]
N_PROMPTS, G, NEW_TOKENS = 4, 2, 4


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from rlpipe.stages.preferences.synthetic import write_synthetic_preferences

    root = tmp_path_factory.mktemp("data")
    cfg = get_stage("task").config_class()(train=root / "train", heldout=root / "heldout", a_range=(0, 19),
                                           b_range=(0, 19), n_train=N_PROMPTS, n_heldout=1, seed=0)
    get_stage("task").run(cfg)
    write_synthetic_preferences(root / "prefs", 10, kind="keyword", seed=0)
    return {"prompts": root / "train", "prefs": root / "prefs"}


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def base(request, tmp_path_factory, tiny_tokenizer):
    """A random-init causal LM of the architecture, saved with the tiny tokenizer."""
    clear_cache()
    name = request.param
    tok = copy.deepcopy(tiny_tokenizer)
    if not ARCHITECTURES[name][2]:
        tok.pad_token = None
    model = build_model(name, tok)
    path = save_pretrained(model, tok, tmp_path_factory.mktemp(name) / "base")
    return {"name": name, "path": path, "root": path.parent}


def _run(stage: str, **fields):
    return get_stage(stage).run(get_stage(stage).config_class()(**fields))


@pytest.fixture(scope="module")
def sft(base, data):
    out = base["root"] / "sft"
    _run("sft", base=base["path"], prompts=data["prompts"], output=out, max_steps=1, batch_size=N_PROMPTS,
         lr=1e-2, max_length=32)
    return out


@pytest.fixture(scope="module")
def reward_model(base, data, sft):
    out = base["root"] / "rm"
    _run("reward_model", preferences=data["prefs"], base=sft, output=out, eval_fraction=0.2, batch_size=8,
         epochs=1, lr=1e-3, max_length=64)
    return out


@pytest.fixture(scope="module")
def rollouts(base, data, sft):
    out = base["root"] / "rollouts"
    _run("rollout", checkpoint=sft, prompts=data["prompts"], output=out, group_size=G,
         max_new_tokens=NEW_TOKENS, temperature=1.0, device="cpu", seed=1)
    return out


@pytest.fixture(scope="module")
def scores(base, rollouts, reward_model):
    out = base["root"] / "scores"
    _run("score", rollouts=rollouts, output=out,
         components=[{"name": "rm", "type": "reward_model", "checkpoint": str(reward_model), "device": "cpu"}])
    return out


@pytest.fixture(scope="module")
def critic(base, sft):
    out = base["root"] / "critic"
    _run("critic_init", policy=sft, output=out, head="normal", seed=3)
    return out


@pytest.fixture(scope="module")
def reference(base, rollouts, sft, critic):
    out = base["root"] / "reference"
    _run("reference", rollouts=rollouts, output=out, reference_model=sft, critic=critic, device="cpu")
    return out


@pytest.fixture(scope="module")
def optimized(base, sft, rollouts, scores, reference, critic):
    adv = base["root"] / "advantages"
    _run("advantage", scores=scores, rollouts=rollouts, reference=reference, output=adv, estimator="gae")
    out = base["root"] / "policy1"
    _run("optimize", policy=sft, rollouts=rollouts, advantages=adv, reference=reference, critic=critic,
         critic_output=base["root"] / "critic1", output=out, metrics_output=base["root"] / "metrics",
         lr=1e-2, critic_lr=1e-2, micro_batch_size=N_PROMPTS * G, dtype="fp32")
    return out


def _tensors(path):
    files = [path / "model.safetensors"] + ([path / HEAD_FILE] if (path / HEAD_FILE).is_file() else [])
    return {f"{f.name}:{k}": v for f in files for k, v in load_file(f).items()}


def _changed(a, b) -> float:
    """Largest parameter change between two checkpoints with the same tensors."""
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    return max(float((ta[k] - tb[k]).abs().max()) for k in ta)


@pytest.mark.architectures
@pytest.mark.slow
def test_sft_first_loss_is_the_base_models_answer_nll(base, data, sft):
    """Step 0's logged loss = -(1/N) sum log p(answer + EOS tokens | prompt) under the base model
    (one batch of every prompt), recomputed through forward.py's right-padded forward."""
    model, tok = load_checkpoint(base["path"])
    assert tok.pad_token_id is not None and (ARCHITECTURES[base["name"]][2] or tok.pad_token_id == tok.eos_token_id)
    rows = read_table_artifact(data["prompts"]).to_pylist()
    prompts = [tok(r["prompt"]).input_ids for r in rows]
    answers = [tok(r["answer"], add_special_tokens=False).input_ids + [tok.eos_token_id] for r in rows]
    logp = teacher_forced_logprobs(model, prompts, answers, tok.pad_token_id)
    nll = -sum(float(x.astype(np.float64).sum()) for x in logp) / sum(len(a) for a in answers)
    metrics = read_table_artifact(sft.with_name("sft_metrics")).to_pylist()
    loss = next(m["value"] for m in metrics if m["name"] == "loss" and m["step"] == 0)
    if base["name"] in DROPOUT:
        # SFT trains with the model's dropout on (as the Hugging Face Trainer does): the first loss
        # is the NLL under a dropout sample, not the eval-mode NLL (optimize turns dropout off).
        assert loss != pytest.approx(nll, rel=1e-5) and loss == pytest.approx(nll, rel=0.2)
    else:
        assert loss == pytest.approx(nll, rel=1e-5)  # fp32 sums of ~40 terms of size ~6: ~1e-6 relative
    assert _changed(base["path"], sft) > 1e-4  # the step moved the weights (lr 1e-2, Adam: ~1e-2)


@pytest.mark.architectures
@pytest.mark.slow
def test_reward_is_the_head_at_the_last_token(reward_model):
    check_reward_checkpoint(reward_model)
    assert json.loads((reward_model / "config.json").read_text())["rlpipe_scalar_head"]["kind"] == "reward"
    model, tok = load_model(reward_model, "reward", cache=False)
    prompts, responses = ["Q: 3+4= A:", "Q: 12+19= A:", "hello"], [" 7", " 31 and more", " world"]
    got = score_texts(model, tok, prompts, responses, max_length=64, batch_size=3)  # right-padded batch
    head = load_file(reward_model / HEAD_FILE)
    assert set(head) == {"weight"}  # a reward head has no bias (Bradley-Terry gives it no gradient)
    for i, ids in enumerate(encode(tok, prompts, responses, 64)):
        with torch.no_grad():
            h = model.backbone(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        assert float(got[i]) == pytest.approx(float(h @ head["weight"][0]), abs=1e-5)
    assert float(got.std()) > 0


@pytest.mark.architectures
@pytest.mark.slow
def test_rollout_logprobs_equal_a_teacher_forced_forward(rollouts, sft):
    """Left-padded KV-cache decoding vs one right-padded forward of prompt + response: the same
    function in fp32; they differ by summation order only (~1e-6), bounded here by 1e-4."""
    table = read_table_artifact(rollouts, ROLLOUTS)
    assert table.num_rows == N_PROMPTS * G
    prompts = table.column("prompt_token_ids").to_pylist()
    responses = table.column("response_token_ids").to_pylist()
    assert len({len(p) for p in prompts}) > 1  # prompts of different lengths: the batch was padded
    model, tok = load_checkpoint(sft)
    want = teacher_forced_logprobs(model, prompts, responses, tok.pad_token_id)
    got = table.column("response_logprobs").to_pylist()
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g, dtype=np.float32), w, atol=1e-4, rtol=0)


@pytest.mark.architectures
@pytest.mark.slow
def test_scores_are_the_reward_models(scores, rollouts, reward_model):
    s = read_table_artifact(scores).column("reward__rm").to_pylist()
    r = read_table_artifact(rollouts, ROLLOUTS)
    model, tok = load_model(reward_model, "reward", cache=False)
    want = score_texts(model, tok, r.column("prompt").to_pylist(), r.column("response").to_pylist(),
                       max_length=1024, batch_size=3).numpy()
    np.testing.assert_allclose(s, want, atol=1e-5)


@pytest.mark.architectures
@pytest.mark.slow
def test_critic_values_at_init_are_the_policy_backbone_plus_head(reference, rollouts, critic, sft):
    """V_t = w . h[P + t - 1] + c with h from the *policy's* backbone (the critic copied it) and
    (w, c) from scalar_head.safetensors; reference log-probs = the policy's teacher-forced ones."""
    policy, tok = load_checkpoint(sft)
    head = load_file(critic / HEAD_FILE)
    r = read_table_artifact(rollouts, ROLLOUTS)
    ref = read_table_artifact(reference, REFERENCE)
    prompts, responses = r.column("prompt_token_ids").to_pylist(), r.column("response_token_ids").to_pylist()
    for p, a, values in zip(prompts, responses, ref.column("values").to_pylist(), strict=True):
        with torch.no_grad():
            h = policy.base_model(input_ids=torch.tensor([p + a])).last_hidden_state[0]
        want = (h @ head["weight"][0] + head["bias"][0])[len(p) - 1 : len(p) - 1 + len(a)]
        np.testing.assert_allclose(values, want.numpy(), atol=1e-5, rtol=0)
    assert max(abs(v) for row in ref.column("values").to_pylist() for v in row) > 1e-4
    want = teacher_forced_logprobs(policy, prompts, responses, tok.pad_token_id)
    for got, w in zip(ref.column("ref_logprobs").to_pylist(), want, strict=True):
        np.testing.assert_allclose(np.asarray(got, dtype=np.float32), w, atol=1e-6, rtol=0)


@pytest.mark.architectures
@pytest.mark.slow
def test_optimize_with_a_critic_updates_both_and_writes_loadable_checkpoints(optimized, sft, critic, base):
    root = base["root"]
    assert read_manifest(optimized).kind == "checkpoint"
    metrics = {m["name"]: m["value"] for m in read_table_artifact(root / "metrics").to_pylist() if m["step"] == 1}
    # old log-probs are recomputed on the same micro-batch: the first step's ratio is exactly 1
    assert metrics["ratio_min"] == pytest.approx(1.0, abs=1e-6) and metrics["ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert np.isfinite(metrics["value_loss"]) and metrics["value_loss"] > 0
    assert _changed(sft, optimized) > 1e-4 and _changed(critic, root / "critic1") > 1e-4
    # the files hold what the stage kept in memory for the next iteration
    for path, kind in ((optimized, "causal"), (root / "critic1", "critic")):
        kept, _ = load_model(path, kind)
        loaded, _ = load_model(path, kind, cache=False)
        assert type(loaded) is type(kept)
        assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in kept.state_dict().items())
    assert isinstance(load_model(root / "critic1", "critic", cache=False)[0], ScalarHeadModel)


# ---- fast checks of the helpers (not part of the matrix) ----

def test_context_length_whatever_the_config_calls_it():
    import transformers

    lengths = {name: context_length(getattr(transformers, cls)(**sizes)) for name, (cls, sizes, _) in ARCHITECTURES.items()}
    assert lengths == {name: (None if name == "bloom" else 128) for name in ARCHITECTURES}
    for key in ("max_position_embeddings", "n_positions", "seq_length", "max_sequence_length", "n_ctx"):
        assert context_length({key: 77, "hidden_size": 8}) == 77
    assert context_length({"text_config": {"max_position_embeddings": 9}, "vision_config": {}}) == 9
    assert context_length({"hidden_size": 8}) is None


def test_pad_is_eos_when_the_tokenizer_has_none_logged_once(tiny_tokenizer, tmp_path, caplog):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="rlpipe.stages.common.tiny"):
        first, second = load_tokenizer(tmp_path), load_tokenizer(tmp_path)
    assert first.pad_token_id == second.pad_token_id == tiny_tokenizer.eos_token_id
    assert [r.getMessage() for r in caplog.records].count(
        f"{tmp_path}: the tokenizer has no pad token; padding with eos '<|eos|>' (id {tiny_tokenizer.eos_token_id})") == 1


def test_legacy_token_classification_critic_loads_with_equal_values(tiny_tokenizer, tmp_path):
    """A LlamaForTokenClassification critic (what critic_init wrote before the scalar-head format)."""
    from transformers import LlamaConfig, LlamaForTokenClassification

    torch.manual_seed(0)
    legacy = LlamaForTokenClassification(LlamaConfig(
        vocab_size=len(tiny_tokenizer), num_labels=1, **{k: v for k, v in ROPE.items()})).eval()
    with torch.no_grad():
        legacy.score.bias.fill_(0.25)  # the bias must survive the conversion too
    path = save_pretrained(legacy, tiny_tokenizer, tmp_path / "legacy")
    critic, _ = load_model(path, "critic", cache=False)
    assert isinstance(critic, ScalarHeadModel) and critic.kind == "critic"
    ids = torch.tensor([tiny_tokenizer("Q: 1+2= A: 3").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(critic(input_ids=ids).logits, legacy(input_ids=ids).logits, atol=1e-6, rtol=0)
    # re-saved, it is in the scalar-head format and reads back the same
    critic.save_pretrained(tmp_path / "new")
    tiny_tokenizer.save_pretrained(tmp_path / "new")
    again, _ = load_model(tmp_path / "new", "critic", cache=False)
    assert json.loads((tmp_path / "new" / "config.json").read_text())["architectures"] == ["LlamaModel"]
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in critic.state_dict().items())
