"""Metric sinks, read back with their own libraries: the values logged at each step are the run's
summary (`report.run_table`), the hyper-parameters are the resolved preset, and the sample tables
are the iteration's completions with their rewards."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest

from rlpipe.pipelines.preset import load_preset
from rlpipe.pipelines.report import run_table, sample_completions
from rlpipe.pipelines.sinks import flatten
from rlpipe.schemas.config_files import ConfigError

pytestmark = pytest.mark.loggers


def _expected(mini_run) -> dict[int, dict[str, float]]:
    """step -> {metric: value} as every sink must have logged it."""
    table = run_table(mini_run.run_dir)
    return {row.pop("iteration"): {k: v for k, v in row.items() if v is not None}
            for row in table.iter_rows(named=True)}


def _hparams(mini_run) -> dict:
    import yaml

    return flatten(yaml.safe_load((mini_run.run_dir / "preset.yaml").read_text()))


def test_tensorboard_events_hold_the_summary_hparams_and_samples(mini_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(mini_run.run_dir / "logs" / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    expected = _expected(mini_run)
    names = {n for m in expected.values() for n in m}
    assert set(acc.Tags()["scalars"]) == names
    for name in names:
        logged = {e.step: e.value for e in acc.Scalars(name)}
        # event files store scalars as float32: equal to the float64 summary within its rounding
        assert logged == {s: pytest.approx(m[name], rel=2**-23) for s, m in expected.items() if name in m}, name
    content = plugin_data_pb2.HParamsPluginData.FromString(acc.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    hp = content.session_start_info.hparams
    assert hp["optimize.lr"].number_value == pytest.approx(1e-3)
    assert hp["rollout.group_size"].number_value == 4 and hp["name"].string_value == "mini"
    assert set(hp) == set(_hparams(mini_run))
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors("samples/text_summary")}
    assert set(texts) == {1, 2}
    for step, text in texts.items():
        samples = sample_completions(mini_run.run_dir, step - 1)
        rows = text.split("\n")[2:]  # header, separator, then one line per completion
        assert len(rows) == samples.height
        assert rows[0].startswith(f"| {samples['prompt'][0]} |")
        assert [r.split(" | ")[2] for r in rows] == [f"{v:.4g}" for v in samples["reward"]]


def test_mlflow_store_holds_the_summary_params_and_sample_tables(mini_run):
    from mlflow import MlflowClient

    store = mini_run.run_dir / "logs" / "mlflow"
    client = MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("rlpipe").experiment_id])
    assert run.info.run_name == "mini" and run.info.status == "FINISHED"
    expected = _expected(mini_run)
    for name in {n for m in expected.values() for n in m}:
        logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        assert logged == {s: m[name] for s, m in expected.items() if name in m}, name  # float64: exact
    assert run.data.params == {k: str(v) for k, v in _hparams(mini_run).items()}
    for step in (1, 2):
        local = Path(client.download_artifacts(run.info.run_id, f"samples/iteration_{step:04d}.json"))
        data = json.loads(local.read_text())
        samples = sample_completions(mini_run.run_dir, step - 1)
        assert data["columns"] == samples.columns
        assert [r[:3] for r in data["data"]] == [list(r[:3]) for r in samples.iter_rows()]


def wandb_records(path: Path):
    """The records of a W&B transaction log (run-*.wandb), parsed with wandb's protobuf.

    wandb 0.31 reads these files only in its Go core, so the framing is read here: a 7-byte
    header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a 7-byte
    header (CRC32 of type byte + data, length, type: 1 full, 2 first, 3 middle, 4 last), the
    LevelDB log format; every chunk's checksum is verified."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    block, pos, pending = 32 * 1024, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"bad checksum at byte {pos} of {path}"
        pos += 7 + length
        pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_holds_the_summary_config_and_sample_tables(mini_run):
    [run_dir] = (mini_run.run_dir / "logs" / "wandb" / "wandb").glob("offline-run-*")
    [log] = run_dir.glob("run-*.wandb")
    history: dict[int, dict] = {}
    config: dict = {}
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            history[items["_step"]] = items
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
    expected = _expected(mini_run)
    assert set(history) == {1, 2}
    for step, metrics in expected.items():
        assert {k: v for k, v in history[step].items() if k in metrics} == metrics  # JSON float64: exact
        table = json.loads((run_dir / "files" / history[step]["samples/path"]).read_text())
        samples = sample_completions(mini_run.run_dir, step - 1)
        assert table["columns"] == samples.columns
        assert [r[:3] for r in table["data"]] == [list(r[:3]) for r in samples.iter_rows()]
    config.pop("_wandb", None)
    assert config == _hparams(mini_run)


def test_unknown_logger_is_refused_with_the_known_ones(mini_preset_file):
    with pytest.raises(ConfigError, match=r"loggers.*unknown logger\(s\) \['tensorbaord'\]; known: tensorboard, mlflow, wandb"):
        load_preset(mini_preset_file, ["loggers=[tensorbaord]"])
