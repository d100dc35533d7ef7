"""ZeRO-3's weights gathered one module at a time (`deepspeed.full_parameters`): on 2 ranks (torchrun,
gloo), after a training step, the host copy rank 0 builds module by module (each parameter's
partitions gathered to rank 0 alone) is the model gathered whole, bit for bit, and so is the
checkpoint saved from it; no gather holds more than one module's parameters (the whole model
before); the other rank keeps no copy. Tied embeddings (llama, gpt2)
and experts (qwen2_moe), in fp32 and in bf16 (the engine's parameters in bf16)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from architectures import build_model

from rlpipe.cluster.launch import free_port, local_env, torchrun_executable

ARCHS = ("llama", "gpt2", "qwen2_moe")

# Runs on each rank: argv = output JSON, then checkpoint folders.
DRIVER = r"""
import json, sys
from pathlib import Path

import torch

from rlpipe.stages.common import deepspeed as ds
from rlpipe.stages.common.distributed import init_distributed
from rlpipe.stages.common.tiny import load_checkpoint, save_pretrained

info = init_distributed()
deepspeed = ds.import_deepspeed()
real, real_to = deepspeed.zero.GatheredParameters, ds._gathered_to
gathered = []  # (how, elements) of each gather: what it holds at once


def counting(params, *args, **kwargs):
    params = list(params) if not isinstance(params, torch.nn.Parameter) else [params]
    gathered.append(("all", sum(p.ds_numel for p in params)))
    return real(params, *args, **kwargs)


def counting_to(param, writer, to="cpu"):
    gathered.append(("to", param.ds_numel))
    return real_to(param, writer, to)


out, results = Path(sys.argv[1]), {}
for folder in sys.argv[2:]:
    for bf16 in (False, True):
        model, tokenizer = load_checkpoint(folder)
        config = ds.ds_config(3, micro_batch_size=2, grad_accum=1, world_size=2, grad_clip=1.0, bf16=bf16)
        engine = ds.make_engine(model, config, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
        ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(info.rank))
        engine.backward(engine(input_ids=ids).logits.float().pow(2).mean())
        engine.step()  # (the weights moved: what is compared is trained, not the checkpoint read)
        largest = max(sum(p.ds_numel for p in m.parameters(recurse=False)) for m in engine.module.modules())
        total = sum(p.ds_numel for p in engine.module.parameters())
        with real(list(engine.module.parameters()), modifier_rank=None):
            whole = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
            if info.rank == 0:
                save_pretrained(engine.module, tokenizer, out.parent / f"whole-{Path(folder).name}-{bf16}")
        gathered.clear()
        deepspeed.zero.GatheredParameters, ds._gathered_to = counting, counting_to
        with ds.full_parameters(engine, rank=0) as copy:
            deepspeed.zero.GatheredParameters, ds._gathered_to = real, real_to
            key = f"{Path(folder).name}-{'bf16' if bf16 else 'fp32'}"
            if info.rank == 0:
                state = copy.state_dict()
                saved = save_pretrained(copy, tokenizer, out.parent / f"modules-{Path(folder).name}-{bf16}")
                results[key] = {
                    "same": sorted(whole) == sorted(state) and all(
                        whole[k].dtype == state[k].dtype and torch.equal(whole[k], state[k]) for k in whole),
                    "dtypes": sorted({str(v.dtype) for v in state.values()}),
                    "plain": not any(hasattr(p, "ds_id") for p in copy.parameters()),
                    "largest_gather": max(n for _, n in gathered), "largest_module": largest, "total": total,
                    "how": sorted({how for how, _ in gathered}),
                    "whole_files": str(out.parent / f"whole-{Path(folder).name}-{bf16}"), "module_files": str(saved)}
            else:
                results[key] = {"copy": copy is None, "gathers": len(gathered),
                                "how": sorted({how for how, _ in gathered})}
        del engine
    out.with_suffix(f".{info.rank}.json").write_text(json.dumps(results))
"""


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.memory
def test_zero3_gathers_one_module_at_a_time_into_the_same_weights(tmp_path, tiny_tokenizer):
    from rlpipe.stages.common.tiny import save_pretrained

    folders = [save_pretrained(build_model(name, tiny_tokenizer, seed=1), tiny_tokenizer, tmp_path / name)
               for name in ARCHS]
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = local_env(threads_per_rank=1) | {"PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [torchrun_executable(), "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script), str(tmp_path / "out.json"), *map(str, folders)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rank0 = json.loads((tmp_path / "out.0.json").read_text())
    rank1 = json.loads((tmp_path / "out.1.json").read_text())
    assert sorted(rank0) == sorted(f"{a}-{d}" for a in ARCHS for d in ("fp32", "bf16"))
    for key, r in rank0.items():
        assert r["same"] and r["plain"], key
        assert r["dtypes"] == (["torch.bfloat16"] if key.endswith("bf16") else ["torch.float32"]), (key, r["dtypes"])
        # a parameter at a time, gathered to rank 0 alone: at most the largest module's, far
        # below the whole model's
        assert r["how"] == ["to"], (key, r)
        assert r["largest_gather"] <= r["largest_module"] < r["total"] / 2, (key, r)
        for name in sorted(os.listdir(r["whole_files"])):
            if name.endswith(".safetensors"):
                assert (Path(r["whole_files"]) / name).read_bytes() == (Path(r["module_files"]) / name).read_bytes()
        assert rank1[key]["copy"] and rank1[key]["gathers"] > 0 and rank1[key]["how"] == ["to"], (key, rank1[key])
