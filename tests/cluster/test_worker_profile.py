"""RLPIPE_PROFILE_DIR (docs/contributing.md#profiling): a resident member profiles each order into a
pstats file named by stage, member and order; a folder it cannot write to costs a warning, not the
order."""

from __future__ import annotations

import pstats

from rlpipe.cluster.worker import _profiled


def _work() -> int:
    return sum(i * i for i in range(1000))


def test_each_order_is_profiled_into_a_pstats_file(tmp_path, monkeypatch):
    monkeypatch.setenv("RLPIPE_PROFILE_DIR", str(tmp_path / "profiles"))
    with _profiled("rollout.0.3"):
        _work()
    stats = pstats.Stats(str(tmp_path / "profiles" / "rollout.0.3.prof"))
    assert any(func[2] == "_work" for func in stats.stats)


def test_an_unwritable_profile_folder_warns_and_the_order_goes_on(tmp_path, monkeypatch, caplog):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("RLPIPE_PROFILE_DIR", str(tmp_path / "file" / "profiles"))  # (under a file)
    with _profiled("optimize.0.1"):
        done = _work()
    assert done == 332833500
    assert "could not write optimize.0.1.prof" in caplog.text


def test_without_the_variable_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("RLPIPE_PROFILE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    with _profiled("score.0.1"):
        _work()
    assert list(tmp_path.iterdir()) == []
