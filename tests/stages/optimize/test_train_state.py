"""The training state persists across optimize runs (train_state artifacts).

N chained optimize runs (each continuing from the previous run's train_state) equal one plain
PyTorch AdamW over the same N batches: at ZeRO 0 and 2 in one process (warm engines and cold
loads), and on 2 ranks (torchrun, gloo) at ZeRO 2, continued at ZeRO 0 on 1 rank. The LR per
step follows the schedule formula across runs; bf16 keeps fp32 masters that move (on CPU, and on
one CUDA GPU at ZeRO 0-3: `-m gpu`).

Tolerance 1e-5 on the parameters (fp32, CPU): the runs differ from the plain loop only in
summation order (ZeRO's flat buffers, the all-reduce), ~1e-7 relative in the gradient; AdamW's
update lr * m_hat / (sqrt(v_hat) + eps) depends on gradient ratios, so 3 steps at lr 1e-3 move a
parameter by <= 3e-3 with an error of <~ 3e-3 * 1e-6 (far below 1e-5), unless a gradient
component is within ~1e-7 of zero, where the sign of a first step can flip: Adam then moves that
parameter by up to 2 lr differently, which 1e-5 would catch (and the test data, with +-1
advantages on disjoint token halves, has no such components among the trained rows' tokens).
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from rlpipe.cluster.launch import free_port
from rlpipe.stages.optimize.replay import WARM
from rlpipe.stages.optimize.run import clear_warm, run

pytestmark = pytest.mark.train_state
DRIVER = Path(__file__).with_name("torchrun_driver.py")
LR = 1e-3


def _batches(tmp_path, build, tokenizer, n=3):
    return [build(tmp_path / f"data{k}", tokenizer, seed=k, iteration=k) for k in range(n)]


def _chain(tmp_path, batches, policy, make_config, name, **knobs):
    """Configs of N optimize runs, run k continuing from run k-1's policy and train_state."""
    configs, state = [], None
    for k, arts in enumerate(batches):
        cfg = make_config(tmp_path, arts, policy, f"{name}{k}", lr=LR, train_state=state,
                          train_state_output=tmp_path / f"{name}{k}_state", **knobs)
        configs.append(cfg)
        policy, state = cfg.output, cfg.train_state_output
    return configs


def _plain_adamw(policy_dir: Path, batches, *, steps_per_batch: int = 1, autocast: bool = False,
                 lr: float = LR, grad_clip: float = 1.0) -> dict[str, torch.Tensor]:
    """The reference: one torch AdamW over the batches, token-mean PPO-clip with old = detached
    logp (one epoch, the whole batch per step), global-norm clipping; fp32 weights (bf16 compute
    under autocast when asked)."""
    from rlpipe.stages.common.forward import pack, response_logprobs
    from rlpipe.stages.common.tiny import load_checkpoint
    from rlpipe.stages.optimize.data import load_batch, pad_rows
    from rlpipe.stages.optimize.engine import disable_dropout

    model, tok = load_checkpoint(policy_dir, "causal")
    if autocast:  # DeepSpeed's bf16 engine makes its fp32 masters from the bf16-cast module
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
    disable_dropout(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.999))
    for arts in batches:
        batch = load_batch(arts["rollouts"], arts["advantages"])
        rows = list(range(len(batch)))
        packed = pack([batch.prompt_ids[i] for i in rows], [batch.response_ids[i] for i in rows], tok.pad_token_id)
        adv = pad_rows(batch.advantages, rows, packed.mask.shape[1])
        for _ in range(steps_per_batch):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits
            logp = response_logprobs(logits.float(), packed)
            ratio = torch.exp((logp - logp.detach()) * packed.mask)  # == 1, gradient of logp
            loss = (-(adv * ratio) * packed.mask).sum() / packed.mask.sum()  # token-mean, clip inactive
            opt.zero_grad()
            loss.backward()
            if grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 1e-5) -> None:
    for name, w in want.items():
        if name in got:
            diff = (got[name].float() - w.float()).abs().max().item()
            assert diff <= atol, f"{name}: max |diff| {diff:.3g} > {atol}"


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_chained_runs_equal_one_persistent_adamw(tmp_path, tiny_tokenizer, tiny_policy_dir, build, make_config,
                                                 read_metrics, zero_stage):
    batches = _batches(tmp_path, build, tiny_tokenizer)
    want = _plain_adamw(tiny_policy_dir, batches)
    fresh = _plain_adamw(tiny_policy_dir, batches[2:])  # what a fresh AdamW per run would do last
    for mode in ("warm", "cold"):
        configs = _chain(tmp_path, batches, tiny_policy_dir, make_config, f"{mode}_z{zero_stage}_",
                         zero_stage=zero_stage, micro_batch_size=8)
        for cfg in configs:
            if mode == "cold":
                clear_warm()  # every run builds its engine and loads the state from disk
            run(cfg)
        got = load_file(configs[-1].output / "model.safetensors")
        _assert_close(got, want)
        assert read_metrics(configs[-1].metrics_output)[0]["rows"] == 16
        assert json_global_steps(configs[-1].train_state_output) == 3
    # the check has teeth: restarting AdamW each run ends elsewhere (by ~lr per weight)
    name = next(iter(fresh))
    assert (got[name] - fresh[name]).abs().max() > 1e-4


@pytest.mark.slow
@pytest.mark.memory
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_offload_takes_the_same_steps_and_its_state_crosses_offload_on_and_off(
        tmp_path, tiny_tokenizer, tiny_policy_dir, build, make_config, zero_stage):
    """ZeRO-Offload in bf16 with fp32 masters (`offload_optimizer`, and `offload_params` at ZeRO 3):
    three chained runs (each rebuilt from the saved train state) end on the same weights, bit for
    bit, with offload on in none of them, in all, only in the last (a user turning it on to fit a
    bigger policy) or in all but the last: on a CPU run the same AdamW steps the same fp32
    partitions wherever DeepSpeed keeps them, and the state saved either way loads either way."""
    batches = _batches(tmp_path, build, tiny_tokenizer)

    def chain(prefix: str, offloaded: set[int]) -> dict[str, torch.Tensor]:
        configs = _chain(tmp_path, batches, tiny_policy_dir, make_config, prefix, zero_stage=zero_stage,
                         micro_batch_size=8, dtype="bf16")
        for k, cfg in enumerate(configs):
            clear_warm()
            run(cfg.model_copy(update={"offload_optimizer": k in offloaded,
                                       "offload_params": k in offloaded and zero_stage == 3}))
        # the last run's engine did as asked (DeepSpeed's own flags)
        (engines,) = WARM.by_state.values()
        zero = engines.policy.optimizer
        assert (zero.cpu_offload if zero_stage < 3 else zero.offload_optimizer) == (2 in offloaded)
        if zero_stage == 3:
            assert zero.offload_param == (2 in offloaded)
        return load_file(configs[-1].output / "model.safetensors")

    want = chain("off", set())
    moved = {name: t for name, t in want.items() if not torch.equal(t, load_file(
        tmp_path / "off0_policy" / "model.safetensors")[name])}
    assert moved  # (the runs train: the check has teeth)
    for prefix, offloaded in (("on", {0, 1, 2}), ("last", {2}), ("first", {0, 1})):
        got = chain(prefix, offloaded)
        assert all(torch.equal(got[name], want[name]) for name in want), (prefix, zero_stage)


def json_global_steps(state: Path) -> int:
    import json

    return json.loads((state / "topology.json").read_text())["global_steps"]



@pytest.mark.integration
@pytest.mark.slow
def test_two_ranks_zero2_then_one_rank_zero0(tmp_path, tiny_tokenizer, tiny_policy_dir, build, make_config):
    """Runs 1-2 on 2 ranks at ZeRO 2 (torchrun), run 3 continues on 1 rank at ZeRO 0: the state
    crosses ZeRO stage and world size (DeepSpeed's ds_to_universal, state.py), and all 3 equal
    the plain AdamW within 1e-5."""
    from rlpipe.cluster.launch import local_env, stage_command, torchrun_executable

    batches = _batches(tmp_path, build, tiny_tokenizer)
    configs = _chain(tmp_path, batches, tiny_policy_dir, make_config, "r", zero_stage=2, micro_batch_size=4)
    yamls = []
    for cfg in configs[:2]:
        path = tmp_path / f"{cfg.output.name}.yaml"
        path.write_text(yaml.safe_dump(cfg.resolved()))
        yamls.append(str(path))
    cmd = stage_command("optimize", nproc_per_node=2, master_port=free_port())
    cmd = [torchrun_executable(), *cmd[1:cmd.index("-m")], str(DRIVER), *yamls]
    env = local_env(threads_per_rank=1)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), os.getcwd()]))
    want = _plain_adamw(tiny_policy_dir, batches)  # overlaps the 2-rank job
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:]
    two_ranks = _plain_adamw(tiny_policy_dir, batches[:2])
    _assert_close(load_file(configs[1].output / "model.safetensors"), two_ranks)
    last = configs[2].model_copy(update={"zero_stage": 0})
    clear_warm()
    run(last)
    _assert_close(load_file(last.output / "model.safetensors"), want)


@pytest.mark.slow
def test_lr_per_step_follows_the_schedule_across_runs(tmp_path, tiny_tokenizer, tiny_policy_dir, build, make_config,
                                                      read_metrics):
    # 2 steps per run (minibatch 8 of 16 rows), 3 runs: steps s = 0..5 of a 6-step cosine run with
    # 2 warm-up steps and a floor of 0.1: lr_s = LR (s + 1) / 2 for s < 2, then
    # LR (0.1 + 0.9 (1 + cos(pi (s - 2) / 4)) / 2).
    batches = _batches(tmp_path, build, tiny_tokenizer)
    configs = _chain(tmp_path, batches, tiny_policy_dir, make_config, "lr", minibatch_size=8, micro_batch_size=8,
                     lr_schedule="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    got = []
    for cfg in configs:
        run(cfg)
        m = read_metrics(cfg.metrics_output)
        got += [m[1]["lr"], m[2]["lr"]]
    want = [LR * 0.5, LR * 1.0] + [LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 4))) for s in range(2, 6)]
    assert got == pytest.approx(want, rel=1e-12, abs=0)


@pytest.mark.slow
def test_bf16_keeps_fp32_masters_that_move(tmp_path, tiny_tokenizer, tiny_policy_dir, build, make_config):
    from rlpipe.stages.optimize.state import master_weights

    lr = 1e-6
    batches = _batches(tmp_path, build, tiny_tokenizer)
    configs = _chain(tmp_path, batches, tiny_policy_dir, make_config, "bf", zero_stage=2, micro_batch_size=16,
                     dtype="bf16")
    configs = [c.model_copy(update={"lr": lr}) for c in configs]
    for cfg in configs:
        run(cfg)
    masters = {k: v.detach() for k, v in master_weights(configs[-1].train_state_output).items()}  # zero_to_fp32
    # The masters start from the policy cast to bf16 (DeepSpeed builds them from the bf16 module).
    start = {k: v.bfloat16().float() for k, v in load_file(tiny_policy_dir / "model.safetensors").items()}
    want = _plain_adamw(tiny_policy_dir, batches, autocast=True, lr=lr)
    assert_fp32_masters(masters)
    names = [k for k in masters if k in start]  # (a tied lm_head is saved once, as the embedding)
    assert len(names) == len(start)
    moved = torch.cat([(masters[k] != start[k]).flatten() for k in names])
    assert moved.float().mean() > 0.99
    # As the bf16-autocast + fp32-AdamW loop moves them. Adam's step is lr * m_hat / sqrt(v_hat):
    # ~lr per weight whatever the gradient's scale, so the two runs differ only through the
    # gradients' relative error eps_g between DeepSpeed's all-bf16 compute and autocast (fp32
    # softmax/norms, fp32 grads): a few bf16 roundings deep, eps_g ~ 4 * 2^-8 ~ 1.5%. It changes
    # steps 2-3 (ratios of gradients) by ~eps_g relative, and flips the first step's sign where a
    # component is within eps_g of zero, a fraction f ~ 0.2% of weights each off by ~2 lr:
    # ||d - d_ref|| / ||d_ref|| ~ sqrt(eps_g^2 + 4 f) ~ 0.09 < 0.1. (Measured: 0.049.) fp32 masters
    # that were bf16 could not move by 1e-6 at all (relative error ~1).
    delta = torch.cat([(masters[k] - start[k]).flatten() for k in names])
    delta_ref = torch.cat([(want[k] - start[k]).flatten() for k in names])
    rel = float((delta - delta_ref).norm() / delta_ref.norm())
    assert rel < 0.1


@pytest.mark.slow
def test_bf16_first_adam_step_moves_every_master_by_lr(tmp_path, artifacts, tiny_policy_dir, make_config):
    """Adam's first step is lr * m_hat / sqrt(v_hat) = lr * sign(g) (|g| >> eps): every fp32 master
    moves by lr, at every ZeRO stage. DeepSpeed's ZeRO-0 bf16 wrapper takes a zero-gradient step
    when it is built, which Adam would count (the first step then 0.744 lr; make_engine takes it
    back). The masters near 0.02 hold lr = 1e-6 to fp32's spacing there, 2^-29 ~ 1.9e-9: 0.2%."""
    from rlpipe.stages.optimize.state import master_weights

    start = {k: v.bfloat16().float() for k, v in load_file(tiny_policy_dir / "model.safetensors").items()}
    for zero_stage in (0, 1, 2, 3):
        cfg = make_config(tmp_path, artifacts, tiny_policy_dir, f"z{zero_stage}", zero_stage=zero_stage,
                          dtype="bf16", micro_batch_size=16, minibatch_size=16, lr=1e-6,
                          train_state_output=tmp_path / f"z{zero_stage}_state")
        run(cfg)
        clear_warm()
        masters = master_weights(cfg.train_state_output)
        step = torch.cat([(masters[k] - start[k]).abs().flatten() for k in start if k in masters]) / 1e-6
        assert step.median().item() == pytest.approx(1.0, abs=1e-2), zero_stage


_AUTOCAST_REFERENCE: dict[float, dict[str, torch.Tensor]] = {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
@pytest.mark.parametrize("mode", ["warm", "cold"])
def test_bf16_chain_on_cuda_keeps_fp32_masters_that_follow_autocast_adamw(
        tmp_path, tiny_tokenizer, tiny_policy_dir, build, make_config, read_metrics, zero_stage, mode):
    """On one CUDA GPU, dtype=auto is bf16 (DeepSpeed's bf16 engine: bf16 compute, fp32 masters).
    Three chained runs at lr 1e-6, warm (engine kept) or cold (rebuilt, the state read back from
    disk, ZeRO-3's partitions included), keep fp32 masters that move as the bf16-autocast +
    fp32-AdamW loop moves them (the bound of test_bf16_keeps_fp32_masters_that_move, on CPU), at
    every ZeRO stage; the policy the next rollout reads is those masters in bf16."""
    from rlpipe.stages.optimize.state import master_weights

    lr = 1e-6
    batches = _batches(tmp_path, build, tiny_tokenizer)
    # The reference before any engine: a ZeRO-3 engine leaves DeepSpeed's linear (zero/linear.py)
    # in torch.nn.functional, whose CUDA autocast decorators make the reference's CPU autocast
    # backward mix bf16 and fp32. The batches are seeded, so one reference serves every case.
    if lr not in _AUTOCAST_REFERENCE:
        _AUTOCAST_REFERENCE[lr] = _plain_adamw(tiny_policy_dir, batches, autocast=True, lr=lr)
    want = _AUTOCAST_REFERENCE[lr]
    configs = _chain(tmp_path, batches, tiny_policy_dir, make_config, f"z{zero_stage}", zero_stage=zero_stage,
                     micro_batch_size=16, dtype="auto")
    configs = [c.model_copy(update={"lr": lr}) for c in configs]
    for cfg in configs:
        if mode == "cold":
            clear_warm()
        run(cfg)
    clear_warm()  # free the GPU for the next case
    assert read_metrics(configs[0].metrics_output)[1]["ratio_max"] == 1.0  # old log-probs in bf16 too
    masters = {k: v.detach().cpu() for k, v in master_weights(configs[-1].train_state_output).items()}
    start = {k: v.bfloat16().float() for k, v in load_file(tiny_policy_dir / "model.safetensors").items()}
    assert_fp32_masters(masters)
    names = [k for k in masters if k in start]
    assert len(names) == len(start)
    assert torch.cat([(masters[k] != start[k]).flatten() for k in names]).float().mean() > 0.99

    delta = torch.cat([(masters[k] - start[k]).flatten() for k in names])
    delta_ref = torch.cat([(want[k] - start[k]).flatten() for k in names])
    assert float((delta - delta_ref).norm() / delta_ref.norm()) < 0.1
    policy = load_file(configs[-1].output / "model.safetensors")
    for k in names:
        assert torch.equal(policy[k].float(), masters[k].bfloat16().float()), k


def assert_fp32_masters(masters: dict[str, torch.Tensor]) -> None:
    """Fails when a bf16 run's saved masters are bf16 (in dtype, or in value: bf16 numbers stored
    as fp32 all survive a round trip through bf16; true fp32 masters that moved by ~1e-6 do not)."""
    assert all(t.dtype == torch.float32 for t in masters.values()), {k: t.dtype for k, t in masters.items()}
    flat = torch.cat([t.flatten() for t in masters.values()])
    representable = (flat.bfloat16().float() == flat).float().mean()
    assert representable < 0.5, f"{representable:.1%} of the masters are bf16 numbers"


def test_the_bf16_master_check_catches_bf16_masters():
    rounded = {"w": torch.randn(1000).bfloat16().float()}
    with pytest.raises(AssertionError):
        assert_fp32_masters(rounded)
    assert_fp32_masters({"w": torch.randn(1000)})
