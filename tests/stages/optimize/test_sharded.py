"""optimize.max_shard_size: a policy above it is written as several safetensors files plus
model.safetensors.index.json (Hugging Face's layout), holding exactly the tensors of the one-file
checkpoint; the transformers rollout engine (loading it, and copying it into a running model that
held other weights) and the reference stage read it to the same log-probs. (vLLM:
tests/stages/rollout/test_vllm_inplace.py samples from a sharded checkpoint, started fresh and
loaded in place.)"""

from __future__ import annotations

import json

from rlpipe.schemas import read_manifest, read_table_artifact
from rlpipe.stages.common import models
from rlpipe.stages.optimize.run import run


def _tensors(path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_a_policy_above_the_shard_size_is_sharded_and_reads_the_same(tmp_path, build, make_config, tiny_tokenizer,
                                                                       tiny_policy_dir):
    from rlpipe.schemas import PROMPTS, write_table_artifact
    from rlpipe.stages.reference.config import ReferenceConfig
    from rlpipe.stages.reference.run import run as reference
    from rlpipe.stages.rollout.config import RolloutConfig
    from rlpipe.stages.rollout.run import run as rollout

    prompts_dir = tmp_path / "prompts"
    write_table_artifact(prompts_dir, PROMPTS, {"prompt_id": [f"p{i}" for i in range(6)],
                                                "prompt": [f"Q: {i}+{2 * i}= A:" for i in range(6)],
                                                "answer": [None] * 6, "metadata": [None] * 6,
                                                "messages": [None] * 6}, stage="test")
    arts = build(tmp_path, tiny_tokenizer)
    whole = make_config(tmp_path, arts, tiny_policy_dir, name="whole", micro_batch_size=16)
    sharded = make_config(tmp_path, arts, tiny_policy_dir, name="sharded", micro_batch_size=16, max_shard_size="150KB")
    run(whole)
    manifest = run(sharded)
    files = sorted(f.name for f in manifest.files)
    shards = [f for f in files if f.startswith("model-") and f.endswith(".safetensors")]
    assert len(shards) >= 2 and "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert all((sharded.output / f).stat().st_size <= 150_000 for f in shards)
    index = json.loads((sharded.output / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    a, b = _tensors(whole.output), _tensors(sharded.output)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)  # the same weights, in another layout

    def sample(checkpoint, out):
        cfg = RolloutConfig(checkpoint=checkpoint, prompts=prompts_dir, output=out, group_size=3, max_new_tokens=8,
                            temperature=1.0, seed=5)
        rollout(cfg)
        return read_manifest(out)

    models.clear_cache()
    loaded = sample(sharded.output, tmp_path / "r_sharded")  # built from the shards
    models.clear_cache()
    one_file = sample(whole.output, tmp_path / "r_whole")
    # In place: the running model holds other weights (a policy of the same architecture trained
    # at another learning rate), and the sharded ones are copied into it; it must then sample as
    # the model built from them.
    other = make_config(tmp_path, arts, tiny_policy_dir, name="other", micro_batch_size=16, lr=1e-2)
    run(other)
    models.clear_cache()
    before = sample(other.output, tmp_path / "r_other")
    in_place = sample(sharded.output, tmp_path / "r_in_place")
    assert [m.extra["timing"]["model_load"] for m in (loaded, one_file, before, in_place)] == [
        "loaded", "loaded", "loaded", "in_place"]
    assert before.content_hash != loaded.content_hash  # so a copy that did nothing would show
    assert loaded.content_hash == one_file.content_hash == in_place.content_hash  # tokens and log-probs

    refs = [reference(ReferenceConfig(rollouts=tmp_path / "r_whole", output=tmp_path / f"ref_{n}",
                                      reference_model=p.output, device="cpu"))
            for n, p in (("whole", whole), ("sharded", sharded))]
    assert refs[0].content_hash == refs[1].content_hash
    assert read_table_artifact(tmp_path / "ref_sharded", "reference").num_rows == loaded.rows
    models.clear_cache()
