"""One optimisation step is the same however its rows are split into ranks and micro-batches.

1 rank x 4 micro-batches == 2 ranks x 2 micro-batches (torchrun, 2 CPU processes, gloo) ==
1 rank x 1 micro-batch of the same global batch == 1 rank with micro-batches cut by a token budget
B == 2 ranks with budget B/2 (as many micro-batches on both ranks, their number varying by step),
for ZeRO 0, 2 and 3 (and the budgets for every other loss aggregation), every forward packed:
parameters within 16 ulps where Adam's two updates were well conditioned and
the same global gradient norm, loss and KL (the gradient norm catches a wrong loss scale, which
Adam's first update would hide). Every run takes its log-probs 3 tokens of logits at a time
(`logprob_chunk_tokens`: several chunks per micro-batch, each recomputed in the backward, under
every ZeRO stage; ZeRO-3's ranks, whose token counts differ, make as many head calls). Chunked
against unchunked values and gradients: tests/stages/common/test_chunked_logprobs.py (Adam's
normalised first steps would amplify their last-bit differences here, on near-zero gradients).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from rlpipe.cluster.launch import free_port, local_env, stage_command, torchrun_executable
from rlpipe.schemas import read_table_artifact
from rlpipe.stages.optimize.losses import AGG_MODES
from rlpipe.stages.optimize.run import run

STAGES = (0, 2, 3)
DRIVER = Path(__file__).with_name("torchrun_driver.py")



@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("environment", [None, 0.0], ids=["single_turn", "episodes"])
def test_ranks_and_micro_batches_give_the_same_update(tmp_path, tiny_tokenizer, build, tiny_policy_dir, make_config,
                                                      read_metrics, environment):
    """(episodes: 3 environment tokens in every response, masked out of every loss and count)"""
    artifacts = build(tmp_path, tiny_tokenizer, environment=environment)
    # two optimizer steps of 8 rows each (minibatch 8 of 16 rows), grad clipping active
    common = dict(lr=1e-3, minibatch_size=8, epochs=1, grad_clip=1.0, logprob_chunk_tokens=3)
    # the token budget: about 2.5 rows of the longest, so a step's 8 rows take 3 to 6 micro-batches
    rollouts = read_table_artifact(artifacts["rollouts"])
    budget = 5 * max(len(p) + len(r) for p, r in zip(rollouts.column("prompt_token_ids").to_pylist(),
                                                      rollouts.column("response_token_ids").to_pylist(), strict=True)) // 2
    configs = {}
    for z in STAGES:
        configs[(z, "1x4")] = make_config(tmp_path, artifacts, tiny_policy_dir, f"z{z}_1x4", zero_stage=z, micro_batch_size=2, **common)
        configs[(z, "1x1")] = make_config(tmp_path, artifacts, tiny_policy_dir, f"z{z}_1x1", zero_stage=z, micro_batch_size=8, **common)
        configs[(z, "2x2")] = make_config(tmp_path, artifacts, tiny_policy_dir, f"z{z}_2x2", zero_stage=z, micro_batch_size=2, **common)
        configs[(z, "1xB")] = make_config(tmp_path, artifacts, tiny_policy_dir, f"z{z}_1xB", zero_stage=z, micro_batch_size=8,
                                          max_tokens_per_micro_batch=budget, **common)
        configs[(z, "2xB/2")] = make_config(tmp_path, artifacts, tiny_policy_dir, f"z{z}_2xB2", zero_stage=z,
                                            micro_batch_size=8, max_tokens_per_micro_batch=budget // 2, **common)
    # every other loss aggregation, cut by tokens (ZeRO 0): its denominators are the step's global counts too
    for agg in AGG_MODES[1:]:
        for split, knobs in (("1x1", {}), ("1xB", {"max_tokens_per_micro_batch": budget}),
                             ("2xB/2", {"max_tokens_per_micro_batch": budget // 2})):
            configs[(agg, split)] = make_config(tmp_path, artifacts, tiny_policy_dir, f"{agg}_{split.replace('/', '')}",
                                                micro_batch_size=8, agg_mode=agg, **knobs, **common)
    yamls = []
    for (z, split), config in configs.items():
        if split.startswith("2x"):
            path = tmp_path / f"z{z}_{split.replace('/', '')}.yaml"
            path.write_text(yaml.safe_dump(config.resolved()))
            yamls.append(str(path))
    cmd = stage_command("optimize", nproc_per_node=2, master_port=free_port())
    # the same launcher line, with the driver script in place of `-m rlpipe.stages.optimize`
    cmd = [torchrun_executable(), *cmd[1:cmd.index("-m")], str(DRIVER), *yamls]
    env = local_env(threads_per_rank=1)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), os.getcwd()]))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for (_, split), cfg in configs.items():  # the 1-rank runs overlap the 2-rank job
        if not split.startswith("2x"):
            run(cfg)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]

    for z in (*STAGES, *AGG_MODES[1:]):
        splits = ("1x4", "2x2", "1xB", "2xB/2") if z in STAGES else ("1xB", "2xB/2")
        params = {split: load_file(configs[(z, split)].output / "model.safetensors") for split in (*splits, "1x1")}
        metrics = {split: read_metrics(configs[(z, split)].metrics_output) for split in params}
        start = load_file(Path(tiny_policy_dir) / "model.safetensors")
        # Adam moves a parameter by lr per step where its gradient keeps its sign and stays far above
        # eps (1e-8), whatever the gradient's last bits: a parameter that moved by ~2 lr over the
        # two steps (>= 1.9 lr) had two such steps, and there the splits must agree to a few ulps
        # of the parameters (16 ulps of 1.0). Elsewhere Adam's g / (|g| + eps) and the ratio of its
        # two moments turn last-bit differences of g into differences of the update (measured: up
        # to 2.8e-6 under a token split); those parameters are left to the gradient norms below.
        conditioned = compared = 0
        for name, ref in params["1x1"].items():
            assert not (ref == start[name]).all() or "norm" in name, f"{name} did not move"
            moved = (ref - start[name]).abs() >= 1.9 * common["lr"]
            conditioned, compared = conditioned + int(moved.sum()), compared + moved.numel()
            for split in splits:
                diff = (params[split][name] - ref)[moved].abs().max().item() if moved.any() else 0.0
                assert diff <= 16 * 2.0 ** -23, f"ZeRO {z} {split} vs 1x1: {name} differs by {diff}"
        assert conditioned > compared / 5, (conditioned, compared)  # (a fair share is compared: ~27%)
        for step in (1, 2):
            for name in ("grad_norm", "loss", "approx_kl", "entropy", "tokens"):
                # (step 2 starts from step 1's parameters, whose Adam-ill-conditioned components a
                # token cut, summing the step in other groupings, moves by up to ~3e-6: its loss
                # then differs by ~1.5e-5 relative; the token cuts are held to step 1 and to the
                # well-conditioned parameters above, which carry both steps)
                for split in (splits if step == 1 else [s for s in splits if "B" not in s]):
                    assert metrics[split][step][name] == pytest.approx(metrics["1x1"][step][name], rel=1e-5, abs=1e-7), (
                        z, split, step, name)
        assert metrics[splits[-1]][1]["ratio_min"] == metrics[splits[-1]][1]["ratio_max"] == 1.0
        assert metrics[splits[-1]][1]["clip_fraction"] == 0.0
    # and the ZeRO stages agree with each other (ZeRO-3 gathers its partitions before saving)
    base = load_file(configs[(0, "1x1")].output / "model.safetensors")
    for z in STAGES[1:]:
        other = load_file(configs[(z, "1x1")].output / "model.safetensors")
        assert max((other[k] - v).abs().max().item() for k, v in base.items()) <= 1e-5, z
