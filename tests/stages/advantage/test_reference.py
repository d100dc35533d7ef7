"""The reference stage (reference log-probs, critic values) and the critic_init stage on the tiny policy.
(Here beside the advantage tests, whose artifact fixtures they share.)"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rlpipe.schemas import REFERENCE, iter_shards, read_manifest, validate_artifact
from rlpipe.stages.common.cli import stage_main
from rlpipe.stages.common.forward import teacher_forced_logprobs
from rlpipe.stages.common.models import load_model
from rlpipe.stages.critic_init.config import CriticInitConfig
from rlpipe.stages.critic_init.run import run as build_critic
from rlpipe.stages.reference.config import ReferenceConfig
from rlpipe.stages.reference.run import run as run_reference


@pytest.fixture(scope="module")
def critic_dir(tmp_path_factory, tiny_policy_dir):
    out = tmp_path_factory.mktemp("critic")
    build_critic(CriticInitConfig(policy=tiny_policy_dir, output=out, head="normal", seed=3))
    return out


@pytest.fixture
def rollouts_dir(tmp_path, tiny_tokenizer, artifacts):
    rng = random.Random(0)
    rows = []
    for g in range(5):
        prompt = tiny_tokenizer(f"Q: {g}+{2 * g}= A:")["input_ids"]
        for s in range(3):
            n = rng.randint(1, 9)
            response = [rng.randrange(3, len(tiny_tokenizer)) for _ in range(n)]
            rows.append(artifacts.rollout(g, s, prompt, response, [-1.0] * n))
    artifacts.write(tmp_path / "rollouts", artifacts.ROLLOUTS_, rows, rows_per_shard=6)  # shards of 6, 6, 3
    return tmp_path / "rollouts"


def test_reference_logprobs_equal_teacher_forced_and_values_match_unpadded_forward(
        tmp_path, rollouts_dir, tiny_policy_dir, critic_dir):
    config = ReferenceConfig(rollouts=rollouts_dir, output=tmp_path / "ref", reference_model=tiny_policy_dir,
                             critic=critic_dir, batch_size=4, device="cpu")
    manifest = run_reference(config)
    assert validate_artifact(tmp_path / "ref") == []
    assert manifest.shard_names == read_manifest(rollouts_dir).shard_names  # one shard per input shard
    assert set(manifest.inputs) == {"rollouts", "reference_model", "critic"}

    policy, tok = load_model(tiny_policy_dir, "causal")
    critic, _ = load_model(critic_dir, "critic")
    shards = zip(iter_shards(rollouts_dir), iter_shards(tmp_path / "ref", REFERENCE), strict=True)
    for (_, rollouts), (_, ref) in shards:
        prompts = rollouts.column("prompt_token_ids").to_pylist()
        responses = rollouts.column("response_token_ids").to_pylist()
        assert ref.column("group_id").to_pylist() == rollouts.column("group_id").to_pylist()
        assert ref.column("sample_index").to_pylist() == rollouts.column("sample_index").to_pylist()
        expected = teacher_forced_logprobs(policy, prompts, responses, tok.pad_token_id, batch_size=4)
        for got, want in zip(ref.column("ref_logprobs").to_pylist(), expected, strict=True):
            assert np.array_equal(np.asarray(got, dtype=np.float32), want)  # exactly
        # V_t = head output at P + t - 1 of the sequence run alone (no padding at all)
        for p, r, got in zip(prompts, responses, ref.column("values").to_pylist(), strict=True):
            with torch.no_grad():
                head = critic(input_ids=torch.tensor([p + r])).logits[0, :, 0]
            want = head[len(p) - 1 : len(p) - 1 + len(r)].numpy()
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
            assert np.abs(want).max() > 1e-4  # the normal-initialised head gives non-trivial values

    # Same inputs: a cache hit, then (forced) the same content hash.
    assert run_reference(config).created_at == manifest.created_at
    assert run_reference(config, force=True).content_hash == manifest.content_hash


def test_zero_head_critic_copies_the_backbone_and_gives_zero_values(tmp_path, rollouts_dir, tiny_policy_dir):
    assert stage_main("critic_init", [f"policy={tiny_policy_dir}", f"output={tmp_path / 'critic0'}", "head=zero"]) == 0
    assert read_manifest(tmp_path / "critic0").kind == "checkpoint"
    critic, _ = load_model(tmp_path / "critic0", "critic", cache=False)
    policy, _ = load_model(tiny_policy_dir, "causal")
    assert type(critic).__name__ == "ScalarHeadModel" and critic.kind == "critic"
    backbone = policy.model.state_dict()
    for name, tensor in critic.backbone.state_dict().items():
        assert torch.equal(tensor, backbone[name]), name
    # CLI, critic only: every value is exactly 0 and ref_logprobs are null.
    assert stage_main("reference", [f"rollouts={rollouts_dir}", f"output={tmp_path / 'ref'}", f"critic={tmp_path / 'critic0'}",
                 "device=cpu"]) == 0
    for _, table in iter_shards(tmp_path / "ref", REFERENCE):
        assert table.column("ref_logprobs").null_count == table.num_rows
        assert all(v == 0.0 for row in table.column("values").to_pylist() for v in row)


def test_reference_config_needs_a_model(tmp_path):
    with pytest.raises(ValueError, match="nothing to compute"):
        ReferenceConfig(rollouts=tmp_path / "rollouts", output=tmp_path / "ref")


@pytest.mark.gpu
def test_reference_on_cuda_matches_cpu(tmp_path, rollouts_dir, tiny_policy_dir, critic_dir):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from rlpipe.stages.common.models import clear_cache

    # fp32 on both ('auto' would be bf16 on the GPU): the same math, to float rounding
    base = dict(rollouts=rollouts_dir, reference_model=tiny_policy_dir, critic=critic_dir, batch_size=4, dtype="fp32")
    try:
        run_reference(ReferenceConfig(**base, output=tmp_path / "cpu", device="cpu"))
        run_reference(ReferenceConfig(**base, output=tmp_path / "gpu", device="cuda"))
    finally:
        clear_cache()  # the cached models moved to the GPU
    for (_, cpu), (_, gpu) in zip(iter_shards(tmp_path / "cpu"), iter_shards(tmp_path / "gpu"), strict=True):
        for col in ("ref_logprobs", "values"):
            for a, b in zip(cpu.column(col).to_pylist(), gpu.column(col).to_pylist(), strict=True):
                np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


def test_token_ids_outside_the_vocabulary_are_named(tmp_path, tiny_policy_dir, artifacts):
    rows = [artifacts.rollout(0, 0, [1, 5], [7, 8], [-1.0, -1.0]), artifacts.rollout(0, 1, [1, 5], [7, 10_000], [-1.0] * 2)]
    artifacts.write(tmp_path / "rollouts", artifacts.ROLLOUTS_, rows)
    with pytest.raises(ValueError, match="part-00000.parquet: row 1 has token id 10000 outside the model's vocabulary"):
        run_reference(ReferenceConfig(rollouts=tmp_path / "rollouts", output=tmp_path / "ref",
                                      reference_model=tiny_policy_dir, device="cpu"))


def _reference_logprobs(path) -> list[np.ndarray]:
    return [np.asarray(x, dtype=np.float32) for _, t in iter_shards(path, REFERENCE)
            for x in t.column("ref_logprobs").to_pylist()]


@pytest.mark.memory
def test_a_bf16_reference_equals_the_bf16_trainer_and_stays_near_fp32(tmp_path, rollouts_dir, tiny_policy_dir):
    """The frozen reference in the run's dtype (`dtype: bf16`, a preset's `model.dtype`): its
    log-probs are, bit for bit, the ones the bf16 trainer computes of the same weights (a ZeRO-0
    DeepSpeed bf16 engine built from the checkpoint, the same batches); and within the bound bf16
    rounding allows of the fp32 reference's."""
    from rlpipe.stages.common import deepspeed as ds
    from rlpipe.stages.common.distributed import init_distributed
    from rlpipe.stages.common.tiny import load_checkpoint

    bf16 = run_reference(ReferenceConfig(rollouts=rollouts_dir, output=tmp_path / "bf16", reference_model=tiny_policy_dir,
                                         batch_size=4, device="cpu", dtype="bf16"))
    fp32 = run_reference(ReferenceConfig(rollouts=rollouts_dir, output=tmp_path / "fp32", reference_model=tiny_policy_dir,
                                         batch_size=4, device="cpu", dtype="fp32"))
    assert bf16.cache_key != fp32.cache_key  # what it computes: in the cache key
    got, want = _reference_logprobs(tmp_path / "bf16"), _reference_logprobs(tmp_path / "fp32")

    init_distributed()
    model, tok = load_checkpoint(tiny_policy_dir)
    engine = ds.make_engine(model, ds.ds_config(0, micro_batch_size=1, grad_accum=1, world_size=1, grad_clip=1.0,
                                                bf16=True), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    rows = [t for _, t in iter_shards(rollouts_dir)]
    prompts = [p for t in rows for p in t.column("prompt_token_ids").to_pylist()]
    responses = [r for t in rows for r in t.column("response_token_ids").to_pylist()]
    trainer = []
    for t in rows:  # (per shard, 4 rows a pass: the reference stage's batches)
        trainer += teacher_forced_logprobs(engine.module, t.column("prompt_token_ids").to_pylist(),
                                           t.column("response_token_ids").to_pylist(), tok.pad_token_id, batch_size=4)
    assert all(np.array_equal(g, w) for g, w in zip(got, trainer, strict=True))

    # bf16 keeps 8 significant bits: u = 2^-8 relative per rounding. The weights, each of the 2
    # layers' residual outputs and the head's logits z are rounded (the layers' sums accumulate in
    # fp32), so |dz| <= (2 x 2 + 2) u max|z| to first order, and logp_a = z_a - logsumexp(z) moves
    # by at most 2 max|dz|.
    with torch.no_grad():
        fp32_model = load_model(tiny_policy_dir)[0]
        z = torch.cat([fp32_model(input_ids=torch.tensor([p + r])).logits[0] for p, r in zip(prompts, responses,
                                                                                             strict=True)])
    bound = 2 * 6 * 2**-8 * float(z.abs().max())
    worst = max(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True))
    assert 0 < worst <= bound, (worst, bound)
