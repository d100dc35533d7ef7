"""The optimize stage on stages/common's plumbing: its DeepSpeed config, no temp files left behind."""

from __future__ import annotations

import tempfile

import pytest

from rlpipe.stages.common.deepspeed import deepspeed_template


def test_config_is_the_template_filled(tmp_path, artifacts, tiny_policy_dir, make_config, monkeypatch):
    from rlpipe.stages.optimize import engine as E
    from rlpipe.stages.optimize.run import run

    seen: list[dict] = []

    class Built(Exception):
        pass

    def stop(model, config, **_):
        seen.append(config)
        raise Built

    monkeypatch.setattr(E, "common_make_engine", stop)
    with pytest.raises(Built):
        run(make_config(tmp_path, artifacts, tiny_policy_dir, micro_batch_size=2, minibatch_size=8,
                        grad_clip=0.3, zero_stage=3, dtype="fp32"))
    expected = deepspeed_template(3) | {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                                        "train_batch_size": 8, "gradient_clipping": 0.3, "bf16": {"enabled": False}}
    assert seen == [expected]  # 16 rows, minibatch 8 = 2 per micro-batch x 4 accumulation steps x 1 rank


def test_single_process_run_leaves_no_temp_dirs(tmp_path, artifacts, tiny_policy_dir, make_config, monkeypatch):
    """A fresh 1-rank process group (the one a plain `python -m` run makes) and its teardown
    leave nothing in the temp directory (no file:// store directories)."""
    from rlpipe.stages.common.distributed import destroy_distributed
    from rlpipe.stages.optimize.run import run

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    assert tempfile.gettempdir() == str(tmp)
    destroy_distributed()  # start the group inside this test, as a fresh process would
    run(make_config(tmp_path, artifacts, tiny_policy_dir, micro_batch_size=4, minibatch_size=8))
    destroy_distributed()
    assert [p.name for p in tmp.iterdir() if p.name.startswith(("rlpipe-pg-", "rlpipe-dist-"))] == []
