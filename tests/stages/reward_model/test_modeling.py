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
        # reference: HF's own forward on each sequence alone (no padding at all)
        single = torch.stack([model(input_ids=torch.tensor([s])).logits[0, 0] for s in seqs])
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
    two = tmp_path / "two"
    two.mkdir()
    cfg = json.loads((tiny_reward_dir / "config.json").read_text())
    cfg["id2label"] = {"0": "a", "1": "b"}
    cfg.pop("num_labels", None)
    (two / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RewardCheckpointError, match="2-label head"):
        check_reward_checkpoint(two)
