"""Launcher command lines and the shipped DeepSpeed templates."""

from __future__ import annotations

import pytest

from rlpipe.cluster.launch import stage_command
from rlpipe.stages.common.deepspeed import deepspeed_template, ds_config


def test_torchrun_and_deepspeed_command_lines():
    assert stage_command("optimize", ["-c", "c.yaml"], nproc_per_node=4, nnodes=2, node_rank=1,
                         master_addr="n0", master_port=1234) == [
        "torchrun", "--nproc_per_node", "4", "--nnodes", "2", "--node_rank", "1", "--master_addr", "n0",
        "--master_port", "1234", "-m", "rlpipe.stages.optimize", "-c", "c.yaml"]
    assert stage_command("optimize", ["x=1"], nproc_per_node=2, launcher="deepspeed") == [
        "deepspeed", "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port", "29500",
        "--module", "rlpipe.stages.optimize", "x=1"]
    with pytest.raises(ValueError, match="hostfile"):
        stage_command("optimize", nnodes=2, launcher="deepspeed")
    with pytest.raises(ValueError, match="topology"):
        stage_command("optimize", nnodes=2, node_rank=2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_templates_are_filled(stage):
    assert deepspeed_template(stage)["zero_optimization"]["stage"] == stage
    cfg = ds_config(stage, micro_batch_size=4, grad_accum=2, world_size=2, grad_clip=1.0, bf16=False)
    assert cfg["train_batch_size"] == 16 and cfg["gradient_clipping"] == 1.0
    assert "auto" not in repr(cfg)
    with pytest.raises(ValueError):
        deepspeed_template(4)
