"""Runs that save no train state (`state_every` > 1): the next run replays their optimize steps.

Chains of optimize runs wired as the pipeline wires them, against the chain that saves a state
after every run. Bitwise equality (torch.equal), not a tolerance: a replayed run is the same
deterministic fp32 CPU computation on the same inputs, from the same state (DeepSpeed's
load_checkpoint restores fp32 masters, AdamW moments and steps exactly, and the RNG state), so
any difference at all is a bug in what is carried or replayed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlpipe.schemas import read_manifest
from rlpipe.schemas.errors import UserError
from rlpipe.stages.optimize.run import clear_warm, run

pytestmark = [pytest.mark.train_state, pytest.mark.slow]
LR = 1e-3


#: A full fine-tuning policy; LoRA adapters (the reference: the base, adapters off) with a PPO
#: critic, whose engine's state is carried and replayed beside the policy's.
VARIANTS = {"full": {}, "lora_critic": {"lora": {"r": 4, "alpha": 8}, "kl_beta": 0.1, "critic": True}}


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(checkpoint).glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[0]}"


def _replayed_runs(checkpoint: Path) -> float:
    """How many earlier runs this run replayed (0: it found the state warm, or needed none)."""
    return read_manifest(checkpoint).extra["timing"].get("replayed_runs", 0.0)


def _chain(tmp_path, make_config, batches, policy, name, knobs, wiring):
    """Configs of chained runs; run k of `wiring` is (the run whose train_state it reads or None,
    the runs it replays, whether it saves a state). Run k starts from run k-1's policy (and critic)."""
    configs, critic = [], policy if knobs.get("critic") else None
    for k, (state_from, replayed, save) in enumerate(wiring):
        extra = {key: value for key, value in knobs.items() if key != "critic"}
        if critic is not None:
            extra.update(critic=critic, critic_output=tmp_path / f"{name}{k}_critic")
        cfg = make_config(tmp_path, batches[k], policy, f"{name}{k}", lr=LR,
                          train_state=configs[state_from].train_state_output if state_from is not None else None,
                          replay=[configs[i].output for i in replayed],
                          train_state_output=tmp_path / f"{name}{k}_state" if save else None, **extra)
        configs.append(cfg)
        policy, critic = cfg.output, cfg.critic_output
    return configs


def _assert_same_models(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        _assert_equal(_weights(a.output), _weights(b.output))
        if b.critic_output is not None:
            _assert_equal(_weights(a.critic_output), _weights(b.critic_output))


@pytest.fixture(params=sorted(VARIANTS))
def knobs(request):
    return VARIANTS[request.param]


@pytest.fixture
def batches(tmp_path, tiny_tokenizer, build):
    return [build(tmp_path / f"data{k}", tiny_tokenizer, seed=k, iteration=k, with_values=True) for k in range(3)]


@pytest.fixture
def saved_every_run(tmp_path, batches, tiny_policy_dir, make_config, knobs):
    """3 chained runs that each save the train state (state_every 1), run."""
    clear_warm()
    configs = _chain(tmp_path, make_config, batches, tiny_policy_dir, "every", knobs,
                     [(None, [], True), (0, [], True), (1, [], True)])
    for cfg in configs:
        run(cfg)
    return configs


def test_a_run_after_an_unsaved_one_replays_it_from_the_saved_state(tmp_path, batches, tiny_policy_dir,
                                                                     make_config, knobs, saved_every_run):
    """Run 0 saves the state, run 1 does not, run 2 continues from run 0's state + run 1 (replay):
    warm (one process, nothing replayed) and cold (fresh engines: run 1 replayed from the state);
    both end bit-identical to the chain that saves every run, policy and critic."""
    for mode in ("warm", "cold"):
        configs = _chain(tmp_path, make_config, batches, tiny_policy_dir, mode, knobs,
                         [(None, [], True), (0, [], False), (0, [1], True)])
        for cfg in configs:
            if mode == "cold":
                clear_warm()  # as in a new process: the engines load the state from disk
            run(cfg)
        assert not (tmp_path / f"{mode}1_state").exists()
        _assert_same_models(configs, saved_every_run)
        assert _replayed_runs(configs[2].output) == (1.0 if mode == "cold" else 0.0)
        assert json.loads((configs[2].train_state_output / "topology.json").read_text())["global_steps"] == 3
    # the replayed run's checkpoint is one of the inputs that key the run
    assert "replay[0]" in read_manifest(configs[2].output).inputs


def test_replay_from_a_fresh_start_and_its_errors(tmp_path, batches, tiny_policy_dir, make_config, knobs,
                                                  saved_every_run):
    """No state saved yet: run 1 replays run 0 from the policy (and critic) it started from. A
    replayed run whose recorded knobs changed since (here its lr) gives other weights: a clear
    error naming the checkpoint. A replay list that does not continue from train_state is refused
    before any work."""
    from rlpipe.schemas.atomic import atomic_write_bytes

    c0, c1 = _chain(tmp_path, make_config, batches, tiny_policy_dir, "fresh", knobs, [(None, [], False), (None, [0], False)])
    run(c0)
    clear_warm()
    run(c1)
    _assert_same_models([c0, c1], saved_every_run[:2])
    assert _replayed_runs(c1.output) == 1.0

    manifest = read_manifest(c0.output)
    edited = manifest.model_copy(update={"config": {**manifest.config, "lr": 2 * LR}})
    atomic_write_bytes(c0.output / "_manifest.json", edited.model_dump_json().encode())
    clear_warm()
    with pytest.raises(UserError, match=rf"replaying the optimize runs up to {c0.output} gave other weights"):
        run(c1, force=True)

    if knobs.get("lora") is None:  # (a LoRA policy is always written: the plan refuses to hold it in memory)
        # run 0's policy as one held in memory only (optimize.policy_weights: with_train_state): its
        # weight file gone, its manifest listing it; the replay checks the replayed bytes' hashes
        weights = [f.name for f in manifest.files if f.name.endswith(".safetensors")]
        for name in weights:
            (c0.output / name).unlink()
        for config, error in ((manifest.config, None), ({**manifest.config, "lr": 2 * LR}, "its manifest records")):
            unwritten = manifest.model_copy(update={"not_written": weights, "config": config})
            atomic_write_bytes(c0.output / "_manifest.json", unwritten.model_dump_json().encode())
            clear_warm()
            if error is None:
                run(c1, force=True)
                _assert_same_models([c1], saved_every_run[1:2])
            else:
                with pytest.raises(UserError, match=rf"up to {c0.output} gave other weights than {error} "
                                                    r"\(weights held in memory only.*model.safetensors differ"):
                    run(c1, force=True)

    # every1 continued from every0's train_state: it cannot be replayed from a fresh start
    every1 = saved_every_run[1].output
    wrong = c1.model_copy(update={"replay": [every1], "output": tmp_path / "wrong_policy"})
    with pytest.raises(UserError, match=r"replay\[0\].*continued from train_state .*every0_state"):
        run(wrong)


def test_a_replayed_run_with_other_engine_knobs_hands_its_state_over(tmp_path, batches, tiny_policy_dir,
                                                                      make_config):
    """Run 0 takes 2 micro-batches per step, run 1 one (another DeepSpeed gradient accumulation:
    another engine). Run 1 replays run 0 on an engine built for it, then moves the state into its
    own engine through a scratch DeepSpeed checkpoint: bit-identical to the chain where run 1
    loads run 0's saved state, warm or cold."""
    clear_warm()
    micro = [{"micro_batch_size": 8}, {"micro_batch_size": 16}]
    saved = [make_config(tmp_path, batches[0], tiny_policy_dir, "s0", lr=LR, train_state_output=tmp_path / "s0_state",
                         **micro[0])]
    saved.append(make_config(tmp_path, batches[1], saved[0].output, "s1", lr=LR, train_state=saved[0].train_state_output,
                             **micro[1]))
    for cfg in saved:
        clear_warm()  # the reference: run 1's engine loads run 0's state from disk
        run(cfg)
    for mode in ("warm", "cold"):
        c0 = make_config(tmp_path, batches[0], tiny_policy_dir, f"{mode}0", lr=LR, **micro[0])
        c1 = make_config(tmp_path, batches[1], c0.output, f"{mode}1", lr=LR, replay=[c0.output], **micro[1])
        run(c0)
        if mode == "cold":
            clear_warm()
        run(c1)
        _assert_equal(_weights(c1.output), _weights(saved[1].output))
        assert _replayed_runs(c1.output) == (1.0 if mode == "cold" else 0.0)
        assert not list(tmp_path.glob(".*engine-transfer"))  # the scratch checkpoint is gone
