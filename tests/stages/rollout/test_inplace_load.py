"""A resident rollout worker loads each new policy into its running model: the transformers
engine's slot (rlpipe.stages.common.models) copies the new checkpoint's weights in place, and the
rollouts it then samples are those of a freshly loaded engine, bit for bit."""

from __future__ import annotations

import pytest

from rlpipe.schemas import read_manifest, read_table_artifact
from rlpipe.stages.common import models
from rlpipe.stages.rollout.config import RolloutConfig
from rlpipe.stages.rollout.run import run


@pytest.fixture(scope="module")
def two_policies(tmp_path_factory, tiny_tokenizer):
    """Two checkpoints of one architecture with other weights (another init seed), and one of
    another size."""
    from rlpipe.stages.common.tiny import build_model, save_pretrained

    root = tmp_path_factory.mktemp("policies")
    return {name: save_pretrained(build_model(tiny_tokenizer, "causal", size=size, seed=seed), tiny_tokenizer,
                                  root / name)
            for name, size, seed in (("a", "tiny", 0), ("b", "tiny", 1), ("c", "micro", 0))}


def _rollout(checkpoint, prompts, out) -> list[dict]:
    cfg = RolloutConfig(checkpoint=checkpoint, prompts=prompts, output=out, group_size=4, max_new_tokens=10,
                        temperature=1.0, seed=3)
    run(cfg)
    return read_table_artifact(out).to_pylist()


def test_a_new_policy_is_copied_into_the_running_model(two_policies, prompts_dir, tmp_path):
    models.clear_cache()
    on_a = _rollout(two_policies["a"], prompts_dir, tmp_path / "a")
    assert read_manifest(tmp_path / "a").extra["timing"]["model_load"] == "loaded"
    model = models.MODELS.slots["rollout"].model
    in_place = _rollout(two_policies["b"], prompts_dir, tmp_path / "b")
    assert read_manifest(tmp_path / "b").extra["timing"]["model_load"] == "in_place"
    assert models.MODELS.slots["rollout"].model is model  # no model built for b
    models.clear_cache()
    fresh = _rollout(two_policies["b"], prompts_dir, tmp_path / "b_fresh")
    assert read_manifest(tmp_path / "b_fresh").extra["timing"]["model_load"] == "loaded"
    # The same fp32 weights in the same module: every forward is the same computation, so the
    # samples and their log-probs are identical, not merely close.
    assert [(r["response_token_ids"], r["response_logprobs"]) for r in in_place] == \
           [(r["response_token_ids"], r["response_logprobs"]) for r in fresh]
    # and b's weights really arrived: a and b (other init) sample other tokens from the same seeds
    assert [r["response_token_ids"] for r in on_a] != [r["response_token_ids"] for r in in_place]
    assert read_manifest(tmp_path / "b").content_hash == read_manifest(tmp_path / "b_fresh").content_hash


def test_another_architecture_is_loaded_and_the_cache_stays_untouched(two_policies, prompts_dir, tmp_path):
    """A checkpoint of another size replaces the slot's model; a model in the shared cache (the
    reference stage's start policy, say) is never overwritten by the slot."""
    models.clear_cache()
    reference, _ = models.load_model(two_policies["a"])  # cached, as the reference stage holds it
    before = {k: v.clone() for k, v in reference.state_dict().items()}
    _rollout(two_policies["c"], prompts_dir, tmp_path / "c")
    assert read_manifest(tmp_path / "c").extra["timing"]["model_load"] == "loaded"
    _rollout(two_policies["a"], prompts_dir, tmp_path / "a")  # the cache has a: taken from there
    assert read_manifest(tmp_path / "a").extra["timing"]["model_load"] == "cache"
    _rollout(two_policies["b"], prompts_dir, tmp_path / "b")  # c's architecture differs: loaded anew
    assert read_manifest(tmp_path / "b").extra["timing"]["model_load"] == "loaded"
    assert all(v.equal(before[k]) for k, v in reference.state_dict().items())
    models.clear_cache()


def test_weights_that_do_not_fit_are_refused(two_policies, tmp_path):
    import shutil

    from rlpipe.stages.common.tiny import load_checkpoint

    model, _ = load_checkpoint(two_policies["a"])
    odd = tmp_path / "odd"
    shutil.copytree(two_policies["c"], odd)
    shutil.copy(two_policies["a"] / "config.json", odd / "config.json")  # says tiny, holds micro weights
    with pytest.raises(RuntimeError, match="size mismatch"):
        models.copy_weights(model, odd)
