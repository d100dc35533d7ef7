"""The one DeepSpeed config: cluster/deepspeed/zero<stage>.json with each stage's knobs filled in."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpipe.stages.common import deepspeed as ds
from rlpipe.stages.common.deepspeed import deepspeed_template


def filled(template: dict, **values) -> dict:
    out = dict(template)
    out.update(values)
    return out


def _captured_config(monkeypatch, module=ds, name="make_engine"):
    """Stop at the engine factory and keep the config a stage built (no training needed to check it);
    returns (configs seen, the exception that stops the stage)."""
    seen: list[dict] = []

    class Built(Exception):
        pass

    def fake(model, config, **_):
        seen.append(config)
        raise Built

    monkeypatch.setattr(module, name, fake)
    return seen, Built


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_config_is_the_templatefilled(stage):
    cfg = ds.ds_config(stage, micro_batch_size=4, grad_accum=3, world_size=2, grad_clip=0.5, bf16=True)
    template = deepspeed_template(stage)
    assert cfg == filled(template, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=3,
                          train_batch_size=24, gradient_clipping=0.5, bf16={"enabled": True})
    assert cfg["zero_optimization"] == template["zero_optimization"]  # untouched: the template's


@pytest.mark.memory
def test_offload_knobs_fill_zero_offload_and_are_refused_where_zero_has_nothing_to_move(tmp_path):
    from rlpipe.stages.optimize.config import OptimizeConfig

    cfg = ds.ds_config(3, micro_batch_size=1, grad_accum=1, world_size=1, grad_clip=1.0,
                       offload_optimizer=True, offload_params=True)
    # (pinned host buffers only where a GPU copies to and from them: this machine has none)
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert cfg["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": False}
    assert cfg["zero_force_ds_cpu_optimizer"] is False  # the torch AdamW steps the offloaded state
    plain = ds.ds_config(2, micro_batch_size=1, grad_accum=1, world_size=1, grad_clip=1.0)
    assert "offload_optimizer" not in plain["zero_optimization"] and "zero_force_ds_cpu_optimizer" not in plain

    base = dict(policy=tmp_path / "p", rollouts=tmp_path / "r", advantages=tmp_path / "a", output=tmp_path / "o",
                metrics_output=tmp_path / "m")
    assert OptimizeConfig(**base, zero_stage=1, offload_optimizer=True).offload_optimizer
    with pytest.raises(ValueError, match="offload_optimizer needs zero_stage 1-3"):
        OptimizeConfig(**base, zero_stage=0, offload_optimizer=True)
    for z in (0, 1, 2):
        with pytest.raises(ValueError, match=f"offload_params needs zero_stage 3 .*got {z}"):
            OptimizeConfig(**base, zero_stage=z, offload_params=True)


def test_sft_builds_its_config_from_the_template(tmp_path, tiny_policy_dir, monkeypatch):
    from rlpipe.stages.sft.config import SFTConfig
    from rlpipe.stages.sft.run import run
    from rlpipe.stages.task.arithmetic import ArithmeticTask, make_splits, write_prompts

    task = ArithmeticTask(a_range=(0, 9), b_range=(0, 9))
    write_prompts(tmp_path / "prompts", make_splits(task, 20, 0, seed=0)[0], split="train", task=task, seed=0)
    seen, built = _captured_config(monkeypatch)
    with pytest.raises(built):
        run(SFTConfig(base=tiny_policy_dir, prompts=tmp_path / "prompts", output=tmp_path / "o",
                      batch_size=8, grad_clip=0.25, zero_stage=2))
    assert seen == [filled(deepspeed_template(2), train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=1,
                            train_batch_size=8, gradient_clipping=0.25, bf16={"enabled": False})]


def test_reward_model_builds_its_config_from_the_template(tmp_path, tiny_policy_dir, monkeypatch):
    from rlpipe.stages.preferences.synthetic import write_synthetic_preferences
    from rlpipe.stages.reward_model.config import RewardModelConfig
    from rlpipe.stages.reward_model.run import run

    write_synthetic_preferences(tmp_path / "prefs", 40, kind="keyword", seed=1)
    seen, built = _captured_config(monkeypatch)
    with pytest.raises(built):
        run(RewardModelConfig(preferences=tmp_path / "prefs", base=tiny_policy_dir, output=tmp_path / "rm",
                              batch_size=4, gradient_accumulation=2, grad_clip=0.75, zero_stage=1))
    assert seen == [filled(deepspeed_template(1), train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2,
                            train_batch_size=8, gradient_clipping=0.75, bf16={"enabled": False})]



def test_notice_before_the_cpu_comm_op_is_built(tmp_path, monkeypatch, capsys):
    """An empty torch_extensions cache: one line says the op is being built; a built one: silence."""
    import deepspeed.comm.comm as ds_comm
    from deepspeed.ops.op_builder.builder import OpBuilder

    from rlpipe.stages.common.log import configure_logging

    configure_logging("INFO")  # (as a command line has it)

    ds.import_deepspeed()
    monkeypatch.setattr(ds_comm, "cdb", None)  # as before the first engine of a process
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "empty"))
    ds._announce_op_build()
    err = capsys.readouterr().err
    assert err.startswith("building DeepSpeed's CPU communication op deepspeed_shm_comm (first use") and str(tmp_path) in err
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "built"))
    (Path(_get_build_directory("deepspeed_shm_comm", verbose=False)) / "deepspeed_shm_comm.so").write_bytes(b"")
    ds._announce_op_build()
    assert capsys.readouterr().err == ""


def test_a_stale_build_lock_is_cleared_and_a_fresh_one_kept(tmp_path, monkeypatch, capsys):
    """A build killed with SIGKILL leaves torch's lock file: every later build would wait on it
    forever. One older than STALE_BUILD_LOCK_S is removed (and said); a fresh one (a build running
    in another process) is left alone."""
    import os
    import time

    import deepspeed.comm.comm as ds_comm
    from deepspeed.ops.op_builder.builder import OpBuilder
    from torch.utils.cpp_extension import _get_build_directory

    from rlpipe.stages.common.log import configure_logging

    configure_logging("INFO")  # (as a command line has it)
    ds.import_deepspeed()
    monkeypatch.setattr(ds_comm, "cdb", None)
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    build = Path(_get_build_directory("deepspeed_shm_comm", verbose=False))
    (build / "deepspeed_shm_comm.so").write_bytes(b"")
    lock = build / "lock"
    lock.touch()
    ds._announce_op_build()
    assert lock.exists() and capsys.readouterr().err == ""  # fresh: another process may be building
    old = time.time() - ds.STALE_BUILD_LOCK_S - 60
    os.utime(lock, (old, old))
    ds._announce_op_build()
    assert not lock.exists()
    assert capsys.readouterr().err.startswith(f"warning: removed {lock}: a build lock 11 min old, left by a killed build")


def test_a_bf16_engine_keeps_the_fp32_buffers_older_deepspeed_casts(tiny_policy_dir):
    """DeepSpeed 0.16 casts a bf16 engine's whole module, rotary frequencies included (0.19 casts
    the parameters only): they are put back in fp32, as transformers keeps them in a bf16 model."""
    import torch

    from rlpipe.stages.common.tiny import load_checkpoint

    model = load_checkpoint(tiny_policy_dir)[0]
    before = {n: b.detach().clone() for n, b in model.named_buffers() if b.dtype == torch.float32}
    assert before  # (the rotary frequencies)
    model.bfloat16()  # what DeepSpeed 0.16 does
    ds._keep_fp32_buffers(model, before)
    assert all(torch.equal(dict(model.named_buffers())[n], b) for n, b in before.items())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_deepspeed_is_imported_without_mlflow_which_stays_importable():
    """DeepSpeed's autotuner imports MLflow where it is installed (the `loggers` extra): seconds of
    every training process's start-up, for nothing rlpipe uses. `import_deepspeed` keeps it out,
    and the MLflow sink imports it afterwards as usual. (A fresh process: this one may hold both.)"""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("mlflow") is None:
        pytest.skip("mlflow is not installed (the loggers extra)")
    script = ("import sys\n"
              "from rlpipe.stages.common.deepspeed import import_deepspeed\n"
              "import_deepspeed()\n"
              "from deepspeed.autotuning import autotuner\n"
              "assert 'mlflow' not in sys.modules and not autotuner.has_mlflow, sorted(sys.modules)[:5]\n"
              "import mlflow\n"
              "assert mlflow.log_metric, mlflow\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
