"""The rollout stage with an environment: episodes as rollouts rows (schema v3), reproducible,
and a killed stage rerun to the same shards."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from rlpipe.schemas import ROLLOUTS, read_manifest
from rlpipe.stages.rollout.config import RolloutConfig
from rlpipe.stages.rollout.run import run as rollout

pytestmark = pytest.mark.multiturn
HERE = Path(__file__).parent
ECHO = {"function": "user_environments:make_echo", "kwargs": {"reply": "Q: 1+1=", "reward": 0.25}, "max_turns": 3}


@pytest.fixture(autouse=True)
def _user_environments(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # user_environments.py


def _config(policy: Path, prompts: Path, out: Path, **knobs) -> RolloutConfig:
    knobs = {"group_size": 2, "max_new_tokens": 4, "groups_per_shard": 2, "batch_size": 2, "seed": 3,
             "environment": ECHO, **knobs}
    return RolloutConfig(checkpoint=policy, prompts=prompts, output=out, **knobs)


def _hashes(art: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(art.glob("part-*.parquet"))}


def test_episodes_are_rows_with_a_mask_turns_and_nulls_where_the_environment_wrote(
        tiny_policy_dir, prompts_dir, tiny_tokenizer, tmp_path):
    manifest = rollout(_config(tiny_policy_dir, prompts_dir, tmp_path / "a"))
    assert manifest.schema_version == ROLLOUTS.version == 3
    df = pl.read_parquet(tmp_path / "a" / "part-*.parquet")
    reply = tiny_tokenizer("\nQ: 1+1=\n", add_special_tokens=False)["input_ids"]
    for row in df.iter_rows(named=True):
        ids, mask, logp, turns = (row[c] for c in ("response_token_ids", "response_mask", "response_logprobs", "turns"))
        assert len(ids) == len(mask) == len(logp)
        assert [lp is None for lp in logp] == [m == 0 for m in mask]
        assert row["num_turns"] == 3 and [t["role"] for t in turns] == ["model", "environment"] * 2 + ["model"]
        assert [t["start"] for t in turns] == [0] + [t["end"] for t in turns[:-1]] and turns[-1]["end"] == len(ids)
        for t in turns:  # the environment's spans are exactly its reply's tokens, and only they are masked
            span = ids[t["start"]:t["end"]]
            assert set(mask[t["start"]:t["end"]]) == {int(t["role"] == "model")}
            if t["role"] == "environment":
                assert span == reply and t["text"] == "\nQ: 1+1=\n" and t["tool_results"] == []
        assert row["environment_reward"] == 0.75  # 0.25 after each of the three model turns
        assert row["response"] == tiny_tokenizer.decode(ids, skip_special_tokens=True)
    extra = manifest.extra
    assert extra["turns_mean"] == 3.0 and extra["response_tokens"] == sum(sum(m) for m in df["response_mask"])
    assert extra["timing"]["environment_steps"] == 3 * len(df)

    rollout(_config(tiny_policy_dir, prompts_dir, tmp_path / "b"))  # same seed: same shards
    assert _hashes(tmp_path / "a") == _hashes(tmp_path / "b")
    rollout(_config(tiny_policy_dir, prompts_dir, tmp_path / "c", seed=4))
    assert _hashes(tmp_path / "a") != _hashes(tmp_path / "c")


def test_single_turn_rollouts_leave_the_episode_columns_null(tiny_policy_dir, prompts_dir, tmp_path):
    rollout(_config(tiny_policy_dir, prompts_dir, tmp_path / "a").model_copy(update={"environment": None}))
    df = pl.read_parquet(tmp_path / "a" / "part-*.parquet")
    assert df.select(pl.col("response_mask", "num_turns", "turns", "environment_reward").null_count()).row(0) == (
        len(df),) * 4
    assert df["response_logprobs"].list.eval(pl.element().is_null().any()).explode().any() is False


@pytest.mark.slow
def test_a_killed_episode_rollout_reruns_to_the_same_shards(tiny_policy_dir, prompts_dir, tmp_path):
    """SIGKILL after the first shard, rerun the same command: the shards equal a straight run's."""
    import yaml

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def command(out: Path) -> list[str]:
        cfg = _config(tiny_policy_dir, prompts_dir, out, groups_per_shard=1, batch_size=1)
        path = out.parent / f"{out.name}.yaml"
        path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        return [sys.executable, "-m", "rlpipe.stages.rollout", "-c", str(path)]

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    subprocess.run(command(straight), check=True, capture_output=True, env=env)
    proc = subprocess.Popen(command(killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    deadline = time.time() + 120
    staged = f".{killed.name}.staging*/part-*.parquet"  # shards are staged, swapped in when all are written
    while not list(tmp_path.glob(staged)) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "_manifest.json").exists(), "the stage ended before the kill"
    subprocess.run(command(killed), check=True, capture_output=True, env=env)
    assert read_manifest(killed).rows == read_manifest(straight).rows
    assert _hashes(killed) == _hashes(straight) and len(_hashes(straight)) > 1
