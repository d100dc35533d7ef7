"""Malformed inputs, one stage run each (`rlpipe stage NAME -c <the run's config> --force`, in this
process) on a copy of the reference run with one thing broken: configs, checkpoints, tokenizers,
prompts, shards, manifests. Every case must stop with exit code 2 and a message naming the file,
key or row, and leave every file of the run as it was: no partial artifact, the previous output
(rewritten with --force) whole, the inputs untouched.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from reliability.helpers import tree_digest

from rlpipe.schemas.hashing import digest_file
from rlpipe.schemas.manifest import FileInfo, content_hash
from rlpipe.stages.common.cli import stage_main

pytestmark = pytest.mark.reliability

IT = "iter_0001"
POLICY = "iter_0000/policy"  # the checkpoint iteration 1 samples from
PROMPTS = "data/task/train"


@dataclass(frozen=True)
class Case:
    id: str
    stage: str
    """The stage run with `-c <run>/<IT>/configs/<stage>.yaml` (or configs/<stage>.yaml: `setup`)."""
    breaks: Callable[[Path], None] = lambda run: None
    """Breaks the copy of the run."""
    args: Callable[[Path], list[str]] = lambda run: []
    """Extra command-line arguments (overrides; absolute paths)."""
    names: Callable[[Path], list[str]] = lambda run: []
    """Texts the error message must contain (the file, key or row, and what is wrong)."""
    setup: bool = False
    code: int = 2
    config: bool = True
    """Pass the run's config file (`-c`)."""
    touched: tuple[str, ...] = field(default_factory=tuple)
    """Paths (relative) the run may change on purpose (none: nothing may change)."""


# -- how things get broken ----------------------------------------------------------------------
def flip_byte(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x01
    path.write_bytes(bytes(data))


def edit_manifest(art: Path, fn: Callable[[dict], None], rehash: bool = False) -> None:
    m = json.loads((art / "_manifest.json").read_text())
    fn(m)
    if rehash:
        m["content_hash"] = content_hash([FileInfo(**f) for f in m["files"]])
    (art / "_manifest.json").write_text(json.dumps(m))


def replace_consistently(shard: Path, table) -> None:
    """A foreign writer: new shard bytes and a manifest that agrees with them."""
    pq.write_table(table, shard)
    def fix(m):
        for f in m["files"]:
            if f["name"] == shard.name:
                f.update(bytes=shard.stat().st_size, xxh3_128=digest_file(shard), sha256=None, rows=table.num_rows)
    edit_manifest(shard.parent, fix, rehash=True)


def write(path: Path, text: str) -> Callable[[Path], None]:
    return lambda run: (run / path).write_text(text)


def shard0(run: Path, art: str) -> Path:
    return run / art / "part-00000.parquet"


# -- the cases ----------------------------------------------------------------------------------
CASES = [
    # configs
    Case("config: unknown key", "score", args=lambda r: ["colour=red"],
         names=lambda r: ["unknown key 'colour'", "allowed keys"]),
    Case("config: value of the wrong type", "rollout", args=lambda r: ["temperature=hot"],
         names=lambda r: ["key 'temperature'", "'hot'"]),
    Case("config: missing required key", "score", config=False, args=lambda r: [f"output={r}/x"],
         names=lambda r: ["missing required key 'rollouts'", "missing required key 'components'"]),
    Case("config: file is not YAML", "score", breaks=write(f"{IT}/configs/score.yaml", "a: [1, 2\n"),
         names=lambda r: [f"{r}/{IT}/configs/score.yaml: not valid YAML"]),
    Case("config: file is a list", "score", breaks=write(f"{IT}/configs/score.yaml", "- 1\n- 2\n"),
         names=lambda r: [f"{r}/{IT}/configs/score.yaml: expected a mapping"]),
    Case("config: file missing", "score", breaks=lambda r: (r / IT / "configs/score.yaml").unlink(),
         names=lambda r: [f"config file {r}/{IT}/configs/score.yaml does not exist"]),
    Case("config: output equal to its input", "score", args=lambda r: [f"output={r}/{IT}/rollouts"],
         names=lambda r: ["output 'output'", "overlaps input 'rollouts'", f"{r}/{IT}/rollouts"]),
    Case("config: output inside its input", "score", args=lambda r: [f"output={r}/{IT}/rollouts/scores"],
         names=lambda r: ["output 'output'", "overlaps input 'rollouts'"]),
    Case("config: output around its input", "advantage", args=lambda r: [f"output={r}/{IT}"],
         names=lambda r: ["output 'output'", "overlaps input 'scores'"]),
    Case("config: invalid regex in a component", "score",
         args=lambda r: ["components=[{name: fmt, type: regex_format, pattern: '('}]"],
         names=lambda r: ["key 'components.0.pattern'", "not a valid regex"]),
    Case("config: infinite component weight", "score",
         args=lambda r: ["components=[{name: c, type: answer_match, weight: .inf}]"],
         names=lambda r: ["key 'components.0.weight'", "finite"]),
    # checkpoints and tokenizers
    Case("model: checkpoint missing", "rollout", args=lambda r: [f"checkpoint={r}/nope"],
         names=lambda r: ["checkpoint", f"{r}/nope"]),
    Case("model: weights bit-flipped", "rollout", breaks=lambda r: flip_byte(r / POLICY / "model.safetensors"),
         names=lambda r: [f"{r}/{POLICY}/model.safetensors: content differs"]),
    Case("model: weights truncated", "rollout",
         breaks=lambda r: (r / POLICY / "model.safetensors").write_bytes((r / POLICY / "model.safetensors").read_bytes()[:1000]),
         names=lambda r: [f"{r}/{POLICY}/model.safetensors", "1000 bytes"]),
    Case("model: config.json edited", "rollout",
         breaks=write(f"{POLICY}/config.json", '{"model_type": "gpt2"}'),
         names=lambda r: [f"{r}/{POLICY}/config.json: content differs"]),
    Case("model: stray weights file added", "rollout",
         breaks=lambda r: shutil.copy(r / POLICY / "model.safetensors", r / POLICY / "model-extra.safetensors"),
         names=lambda r: [f"{r}/{POLICY}: files not listed", "model-extra.safetensors"]),
    Case("model: checkpoint manifest edited", "rollout",
         breaks=lambda r: edit_manifest(r / POLICY, lambda m: m["files"][0].update(xxh3_128="0" * 32)),
         names=lambda r: [f"{r}/{POLICY}/_manifest.json: content_hash does not match"]),
    Case("model: evaluation of a bit-flipped policy", "evaluate",
         breaks=lambda r: flip_byte(r / IT / "policy/model.safetensors", 0.9),
         names=lambda r: [f"{r}/{IT}/policy/model.safetensors: content differs"]),
    Case("model: optimize from a bit-flipped policy", "optimize",
         breaks=lambda r: flip_byte(r / POLICY / "model.safetensors", 0.7),
         names=lambda r: [f"{r}/{POLICY}/model.safetensors: content differs"]),
    Case("tokenizer: tokenizer.json edited", "rollout",
         breaks=lambda r: (r / POLICY / "tokenizer.json").write_text((r / POLICY / "tokenizer.json").read_text().replace('"0"', '"O"', 1)),
         names=lambda r: [f"{r}/{POLICY}/tokenizer.json: content differs"]),
    Case("tokenizer: tokenizer.json deleted", "rollout", breaks=lambda r: (r / POLICY / "tokenizer.json").unlink(),
         names=lambda r: [f"{r}/{POLICY}/tokenizer.json: listed in", "missing"]),
    Case("tokenizer: sft from a base whose tokenizer config changed", "sft", setup=True,
         breaks=write("models/base/tokenizer_config.json", "{}"),
         names=lambda r: [f"{r}/models/base/tokenizer_config.json: content differs"]),
    # prompts
    Case("prompts: shard rewritten with other valid rows", "rollout",
         breaks=lambda r: shutil.copy(shard0(r, "data/task/heldout"), shard0(r, PROMPTS)),
         names=lambda r: [f"{shard0(r, PROMPTS)}: content differs"]),
    Case("prompts: shard truncated", "rollout",
         breaks=lambda r: shard0(r, PROMPTS).write_bytes(shard0(r, PROMPTS).read_bytes()[:64]),
         names=lambda r: [f"{shard0(r, PROMPTS)}", "64 bytes"]),
    Case("prompts: manifest missing", "rollout", breaks=lambda r: (r / PROMPTS / "_manifest.json").unlink(),
         names=lambda r: [f"{r}/{PROMPTS}", "no _manifest.json"]),
    Case("prompts: manifest not JSON", "rollout", breaks=write(f"{PROMPTS}/_manifest.json", "{not json"),
         names=lambda r: [f"{r}/{PROMPTS}/_manifest.json cannot be read"]),
    Case("prompts: an artifact of another schema", "rollout", args=lambda r: [f"prompts={r}/{IT}/scores"],
         names=lambda r: [f"{r}/{IT}/scores", "scores"]),
    Case("prompts: foreign shard missing a column (manifest agrees)", "rollout",
         breaks=lambda r: replace_consistently(shard0(r, PROMPTS), pq.read_table(shard0(r, PROMPTS)).drop_columns(["answer"])),
         names=lambda r: [f"{shard0(r, PROMPTS)}: does not match schema 'prompts'", "missing column 'answer'"]),
    # table shards and manifests between stages
    Case("rollouts: shard bit-flipped", "score", breaks=lambda r: flip_byte(shard0(r, f"{IT}/rollouts")),
         names=lambda r: [f"{shard0(r, f'{IT}/rollouts')}: content differs"]),
    Case("rollouts: shard deleted", "score", breaks=lambda r: shard0(r, f"{IT}/rollouts").unlink(),
         names=lambda r: [f"{shard0(r, f'{IT}/rollouts')}: listed in", "missing"]),
    Case("rollouts: manifest row count lies (hashes agree)", "score",
         breaks=lambda r: edit_manifest(r / IT / "rollouts", lambda m: m["files"][0].update(rows=99), rehash=True),
         names=lambda r: [f"{shard0(r, f'{IT}/rollouts')}: 16 rows, its manifest says 99"]),
    Case("scores: shard rewritten (advantage input)", "advantage",
         breaks=lambda r: shutil.copy(shard0(r, "iter_0000/scores"), shard0(r, f"{IT}/scores")),
         names=lambda r: [f"{shard0(r, f'{IT}/scores')}: content differs"]),
    Case("scores: manifest with an unknown field", "advantage",
         breaks=lambda r: edit_manifest(r / IT / "scores", lambda m: m.update(surprise=1)),
         names=lambda r: [f"{r}/{IT}/scores/_manifest.json: not a valid rlpipe manifest", "surprise"]),
    Case("scores: manifest lists a file that is not there", "advantage",
         breaks=lambda r: shard0(r, f"{IT}/scores").rename(r / IT / "scores/part-00009.parquet"),
         names=lambda r: [f"{shard0(r, f'{IT}/scores')}: listed in", "missing"]),
    Case("advantages: shard bit-flipped (optimize input)", "optimize",
         breaks=lambda r: flip_byte(shard0(r, f"{IT}/advantages")),
         names=lambda r: [f"{shard0(r, f'{IT}/advantages')}: content differs"]),
    Case("advantages: manifest content hash edited", "optimize",
         breaks=lambda r: edit_manifest(r / IT / "advantages", lambda m: m.update(content_hash="0" * 64)),
         names=lambda r: [f"{r}/{IT}/advantages/_manifest.json: content_hash does not match"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_input_stops_with_a_clear_error_and_changes_nothing(case, reference_run, tmp_path, capsys):
    run = tmp_path / "mini"
    shutil.copytree(reference_run, run)
    case.breaks(run)
    before = tree_digest(run)
    config = run / ("configs" if case.setup else f"{IT}/configs") / f"{case.stage}.yaml"
    argv = [*(["-c", str(config)] if case.config else []), *case.args(run), "--force"]
    code = stage_main(case.stage, argv)
    err = capsys.readouterr().err
    assert code == case.code, err
    for text in case.names(run):
        assert text in err, f"{text!r} not in the message:\n{err}"
    assert "Traceback" not in err
    assert tree_digest(run) == before  # nothing written, nothing removed: old outputs and inputs whole
