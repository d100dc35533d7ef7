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


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(checkpoint / "model.safetensors")


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[0]}"


def _replayed_runs(checkpoint: Path) -> float:
    """How many earlier runs this run replayed (0: it found the state warm, or needed none)."""
    return read_manifest(checkpoint).extra["timing"].get("replayed_runs", 0.0)


@pytest.fixture
def batches(tmp_path, tiny_tokenizer, build):
    return [build(tmp_path / f"data{k}", tiny_tokenizer, seed=k, iteration=k) for k in range(3)]


@pytest.fixture
def saved_every_run(tmp_path, batches, tiny_policy_dir, make_config):
    """The policies of 3 chained runs that each save the train state (state_every 1)."""
    clear_warm()
    policy, state, out = tiny_policy_dir, None, []
    for k, arts in enumerate(batches):
        cfg = make_config(tmp_path, arts, policy, f"every{k}", lr=LR, train_state=state,
                          train_state_output=tmp_path / f"every{k}_state")
        run(cfg)
        policy, state = cfg.output, cfg.train_state_output
        out.append(_weights(cfg.output))
    return out


def test_a_run_after_an_unsaved_one_replays_it_from_the_saved_state(tmp_path, batches, tiny_policy_dir,
                                                                     make_config, saved_every_run):
    """Run 0 saves the state, run 1 does not, run 2 continues from run 0's state + run 1 (replay):
    warm (one process, nothing replayed) and cold (fresh engines: run 1 replayed from the state);
    both end bit-identical to the chain that saves every run."""
    for mode in ("warm", "cold"):
        c0 = make_config(tmp_path, batches[0], tiny_policy_dir, f"{mode}0", lr=LR,
                         train_state_output=tmp_path / f"{mode}0_state")
        c1 = make_config(tmp_path, batches[1], c0.output, f"{mode}1", lr=LR, train_state=c0.train_state_output)
        c2 = make_config(tmp_path, batches[2], c1.output, f"{mode}2", lr=LR, train_state=c0.train_state_output,
                         replay=[c1.output], train_state_output=tmp_path / f"{mode}2_state")
        for cfg in (c0, c1, c2):
            if mode == "cold":
                clear_warm()  # as in a new process: the engines load the state from disk
            run(cfg)
        assert not (tmp_path / f"{mode}1_state").exists()
        for cfg, want in zip((c0, c1, c2), saved_every_run, strict=True):
            _assert_equal(_weights(cfg.output), want)
        assert _replayed_runs(c2.output) == (1.0 if mode == "cold" else 0.0)
        assert json.loads((c2.train_state_output / "topology.json").read_text())["global_steps"] == 3
    # the replayed run's checkpoint is one of the inputs that key the run
    assert "replay[0]" in read_manifest(c2.output).inputs


def test_replay_from_a_fresh_start_and_its_errors(tmp_path, batches, tiny_policy_dir, make_config, saved_every_run):
    """No state saved yet: run 1 replays run 0 from the policy it started from. A replayed run
    whose recorded knobs changed since (here its lr) gives other weights: a clear error naming the
    checkpoint. A replay list that does not continue from train_state is refused before any work."""
    from rlpipe.schemas.atomic import atomic_write_bytes

    c0 = make_config(tmp_path, batches[0], tiny_policy_dir, "fresh0", lr=LR)
    c1 = make_config(tmp_path, batches[1], c0.output, "fresh1", lr=LR, replay=[c0.output])
    run(c0)
    clear_warm()
    run(c1)
    _assert_equal(_weights(c1.output), saved_every_run[1])
    assert _replayed_runs(c1.output) == 1.0

    manifest = read_manifest(c0.output)
    edited = manifest.model_copy(update={"config": {**manifest.config, "lr": 2 * LR}})
    atomic_write_bytes(c0.output / "_manifest.json", edited.model_dump_json().encode())
    clear_warm()
    with pytest.raises(UserError, match=rf"replaying the optimize runs up to {c0.output} gave other weights"):
        run(c1, force=True)

    # every1 continued from every0's train_state: it cannot be replayed from a fresh start
    wrong = make_config(tmp_path, batches[2], tmp_path / "every1_policy", "wrong", lr=LR,
                        replay=[tmp_path / "every1_policy"])
    with pytest.raises(UserError, match=r"replay\[0\].*continued from train_state .*every0_state"):
        run(wrong)
