"""The reward is read at the last real token of right-padded sequences."""

import json

import pytest
import torch

from rlpipe.stages.common.models import load_model
from rlpipe.stages.reward_model.modeling import (
    RewardCheckpointError,
    check_reward_checkpoint,
    encode,
    right_pad,
    score_texts,
    sequence_rewards,
)

PROMPTS = ["Q: 1+2= A:", "Q: 13+7= A:", "Q: 4+4= A:"]
RESPONSES = [" 3", " 20 and some more text", " 8"]


def test_padded_batch_matches_single_sequence_forward(tiny_reward_dir):
    model, tok = load_model(tiny_reward_dir, "reward")
    seqs = encode(tok, PROMPTS, RESPONSES, max_length=64)
    assert len({len(s) for s in seqs}) > 1  # the batch really is padded
    input_ids, mask = right_pad(seqs, tok.pad_token_id)
    with torch.no_grad():
        batched = sequence_rewards(model, input_ids, mask)
        # reference: the head at the last token of each sequence run alone (no padding at all)
        single = torch.stack([model(input_ids=torch.tensor([s])).logits[0, -1, 0] for s in seqs])
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-5)
    assert float(single.std()) > 0  # distinct sequences, distinct rewards


def test_score_texts_order_and_batching_invariant(tiny_reward_dir):
    model, tok = load_model(tiny_reward_dir, "reward")
    a = score_texts(model, tok, PROMPTS, RESPONSES, max_length=64, batch_size=2)
    b = score_texts(model, tok, PROMPTS[::-1], RESPONSES[::-1], max_length=64, batch_size=3)
    torch.testing.assert_close(a, b.flip(0), atol=1e-5, rtol=1e-5)


def test_encode_keeps_the_last_tokens(tiny_tokenizer):
    full = encode(tiny_tokenizer, ["Q: 12+13= A:"], [" 25"], max_length=100)[0]
    cut = encode(tiny_tokenizer, ["Q: 12+13= A:"], [" 25"], max_length=4)[0]
    assert cut == full[-4:]


def test_check_reward_checkpoint(tiny_reward_dir, tiny_policy_dir, tmp_path):
    check_reward_checkpoint(tiny_reward_dir)
    with pytest.raises(RewardCheckpointError, match="does not exist"):
        check_reward_checkpoint(tmp_path / "nope")
    with pytest.raises(RewardCheckpointError, match="LlamaForCausalLM.*not a sequence-classification"):
        check_reward_checkpoint(tiny_policy_dir)
    # a legacy sequence-classification checkpoint must have exactly one label
    two = tmp_path / "two"
    two.mkdir()
    cfg = json.loads((tiny_policy_dir / "config.json").read_text())
    cfg["architectures"] = ["LlamaForSequenceClassification"]
    cfg["id2label"] = {"0": "a", "1": "b"}
    (two / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RewardCheckpointError, match="2-label head"):
        check_reward_checkpoint(two)


def test_legacy_sequence_classification_reward_model_loads_unchanged(tiny_tokenizer, tmp_path):
    """A LlamaForSequenceClassification reward model (what the stage wrote before the scalar-head
    format, and what reward models on the Hub are) loads into the same wrapper, same rewards."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rlpipe.stages.common.scalar_head import ScalarHeadModel
    from rlpipe.stages.common.tiny import save_pretrained

    torch.manual_seed(0)
    legacy = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tiny_tokenizer.pad_token_id)).eval()
    path = save_pretrained(legacy, tiny_tokenizer, tmp_path / "legacy")
    check_reward_checkpoint(path)
    model, tok = load_model(path, "reward", cache=False)
    assert isinstance(model, ScalarHeadModel) and model.kind == "reward"
    input_ids, mask = right_pad(encode(tok, PROMPTS, RESPONSES, max_length=64), tok.pad_token_id)
    with torch.no_grad():
        ours = sequence_rewards(model, input_ids, mask)
        # HF pools at the rightmost non-pad id: equal here, the pad id never occurs in a sequence
        theirs = legacy(input_ids=input_ids, attention_mask=mask).logits[:, 0]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert float(ours.std()) > 0


@pytest.mark.memory
@pytest.mark.parametrize("packing", [True, False])
def test_score_texts_token_budget_bounds_every_pass_and_keeps_the_rewards(tiny_reward_dir, monkeypatch, packing):
    """`max_tokens` (the score component's `max_tokens_per_batch`): no forward pass holds more
    tokens than the budget but a sequence longer than it, alone; the rewards are the unbudgeted
    ones (each depends on its own tokens: equal up to the float rounding of another batch layout)."""
    from rlpipe.stages.reward_model import modeling

    prompts, responses = PROMPTS * 4, [r * (1 + i % 3) for i, r in enumerate(RESPONSES * 4)]
    model, tok = load_model(tiny_reward_dir, "reward")
    lengths = [len(s) for s in encode(tok, prompts, responses, max_length=64)]
    passes: list[list[int]] = []
    real = modeling.reward_batch
    monkeypatch.setattr(modeling, "reward_batch", lambda seqs, *a: passes.append([len(s) for s in seqs]) or real(seqs, *a))
    budget = max(lengths) + 3  # a few sequences a pass, none alone by size
    want = score_texts(model, tok, prompts, responses, max_length=64, batch_size=len(prompts), packing=packing)
    assert len(passes) == 1
    passes.clear()
    got = score_texts(model, tok, prompts, responses, max_length=64, batch_size=len(prompts), max_tokens=budget,
                      packing=packing)
    assert len(passes) > 2 and all(sum(p) <= budget for p in passes)
    assert sorted(n for p in passes for n in p) == sorted(lengths)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    passes.clear()
    score_texts(model, tok, prompts, responses, max_length=64, batch_size=len(prompts), max_tokens=2, packing=packing)
    assert [len(p) for p in passes] == [1] * len(prompts)  # every sequence over the budget: alone


def test_a_score_components_batching_is_not_in_the_cache_key(tmp_path):
    from rlpipe.stages.score.config import ScoreConfig

    def config(**rm):
        return ScoreConfig(rollouts=tmp_path / "r", output=tmp_path / "s", components=[
            {"name": "rm", "type": "reward_model", "checkpoint": str(tmp_path / "rm"), **rm},
            {"name": "acc", "type": "answer_match"}])

    plain = config().cache_dict()
    assert config(max_tokens_per_batch=512, packing=False).cache_dict() == plain
    assert "max_tokens_per_batch" in config().resolved()["components"][0]  # (still recorded in the manifest)
    assert config(batch_size=4).cache_dict() != plain  # what it computes: another batch layout
