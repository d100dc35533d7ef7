"""Tiny local tokenizer and models: deterministic, round-trip through Hugging Face format."""

import pytest
import torch

from rlpipe.stages.common.tiny import (
    BOS,
    EOS,
    PAD,
    build_model,
    load_checkpoint,
    make_tiny_checkpoint,
    save_pretrained,
    train_tokenizer,
)

TEXTS = [f"Q: {a}+{b}= A: {a + b}" for a in range(10) for b in range(10)]


def test_tokenizer_round_trips_text(tiny_tokenizer):
    for text in ["Q: 12+7= A: 19", "hello world", "Q: 3+4= A: 7\nnext line", "ünïcödé 🙂"]:
        ids = tiny_tokenizer(text)["input_ids"]
        assert ids[0] == tiny_tokenizer.bos_token_id  # BOS added to every encoded text
        assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == text
    # digits are single tokens: "123" is three tokens
    assert len(tiny_tokenizer("123", add_special_tokens=False)["input_ids"]) == 3
    assert (tiny_tokenizer.pad_token, tiny_tokenizer.bos_token, tiny_tokenizer.eos_token) == (PAD, BOS, EOS)
    assert tiny_tokenizer.padding_side == "left"


def test_tokenizer_is_deterministic():
    a, b = train_tokenizer(TEXTS, vocab_size=300), train_tokenizer(TEXTS, vocab_size=300)
    assert a.get_vocab() == b.get_vocab() and 259 < len(a) <= 300  # 256 bytes + 3 specials + merges


@pytest.mark.parametrize("kind", ["causal", "reward"])
def test_save_load_gives_identical_logits(tmp_path, tiny_tokenizer, kind):
    model = build_model(tiny_tokenizer, kind=kind, size="micro", seed=1).eval()
    out = save_pretrained(model, tiny_tokenizer, tmp_path / kind)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    loaded, tok = load_checkpoint(out, kind=kind)
    batch = tok(["Q: 1+2= A: 3", "Q: 10+5="], return_tensors="pt", padding=True)
    assert batch["input_ids"].tolist() == tiny_tokenizer(["Q: 1+2= A: 3", "Q: 10+5="], padding=True)["input_ids"]
    with torch.no_grad():
        before = model(**batch).logits
        after = loaded(**batch).logits
    assert before.shape[-1] == (len(tiny_tokenizer) if kind == "causal" else 1)
    assert torch.equal(before, after)


def test_models_are_seeded(tiny_tokenizer):
    a = build_model(tiny_tokenizer, size="micro", seed=0).state_dict()
    b = build_model(tiny_tokenizer, size="micro", seed=0).state_dict()
    c = build_model(tiny_tokenizer, size="micro", seed=1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        build_model(tiny_tokenizer, size="huge")


def test_make_tiny_checkpoint_generates(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", TEXTS, size="micro", seed=0)
    model, tok = load_checkpoint(path)
    ids = tok("Q: 1+1=", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=4, do_sample=False)
        again = model.generate(**ids, max_new_tokens=4, do_sample=False)
    n = ids["input_ids"].shape[1]
    assert out[0, :n].tolist() == ids["input_ids"][0].tolist() and 0 < out.shape[1] - n <= 4
    assert torch.equal(out, again)  # greedy decoding of the same weights is reproducible
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_checkpoint(tmp_path)
