"""Checkpoints refused for what they hold: weights pickled with code that would run as they load,
and a config whose `auto_map` names the checkpoint's own code for an architecture transformers
does not ship. Nothing of either runs, and the stage ends as a user error: one `error:`
paragraph naming the file, exit code 2, no traceback. Weights pickled as plain tensors still load."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlpipe.pipelines.cli import app

pytestmark = pytest.mark.reliability


class _RunsCode:
    """Unpickled, it would run `touch <marker>`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _pickled(policy: Path, out: Path, extra: dict) -> Path:
    """`policy` with its weights as pytorch_model.bin (a torch pickle) holding `extra` beside them."""
    import torch
    from safetensors.torch import load_file

    shutil.copytree(policy, out)
    weights = load_file(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    torch.save({**weights, **extra}, out / "pytorch_model.bin")
    return out


def _rollout(tmp_path: Path, checkpoint: Path) -> tuple[int, str]:
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    runner = CliRunner()
    if not (tmp_path / "prompts").exists():
        assert runner.invoke(app, ["data", "import", str(tmp_path / "p.jsonl"), str(tmp_path / "prompts")]).exit_code == 0
    result = runner.invoke(app, ["stage", "rollout", f"checkpoint={checkpoint}", f"prompts={tmp_path / 'prompts'}",
                                 f"output={tmp_path / 'r'}", "max_new_tokens=2", "group_size=2"])
    return result.exit_code, result.output


def _one_paragraph(output: str) -> str:
    assert "Traceback" not in output and output.count("error:") == 1, output
    message = output[output.index("error:"):].strip()
    assert "\n\n" not in message, message
    return message


@pytest.mark.parametrize("held", [False, True], ids=["fresh", "after-a-rollout-of-its-architecture"])
def test_weights_pickled_with_code_are_refused_naming_the_file(tmp_path, tiny_policy_dir, held):
    marker = tmp_path / "code-ran"
    hostile = _pickled(tiny_policy_dir, tmp_path / "hostile", {"extra": _RunsCode(marker)})
    if held:  # the rollout's model slot holds a model of the same architecture: no in-place copy from a pickle
        (tmp_path / "warm").mkdir()
        assert _rollout(tmp_path / "warm", tiny_policy_dir)[0] == 0
    code, out = _rollout(tmp_path, hostile)
    assert code == 2, out
    message = _one_paragraph(out)
    assert message.startswith(f"error: rollout: {hostile}/pytorch_model.bin: its pickle would run code as it "
                              "loads (Trying to load unsupported GLOBAL posix.system"), message
    assert "nothing of it ran" in message and "safetensors" in message
    assert not marker.exists() and not (tmp_path / "r").exists()
    # the same weights pickled as plain tensors load as before
    plain = _pickled(tiny_policy_dir, tmp_path / "plain", {})
    code, out = _rollout(tmp_path, plain)
    assert code == 0, out


def test_a_config_naming_its_own_code_is_refused_naming_the_file(tmp_path, tiny_policy_dir):
    marker = tmp_path / "code-ran"
    hostile = shutil.copytree(tiny_policy_dir, tmp_path / "hostile")
    config = json.loads((hostile / "config.json").read_text())
    config |= {"model_type": "evil", "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                                                  "AutoModelForCausalLM": "modeling_evil.EvilModel"}}
    (hostile / "config.json").write_text(json.dumps(config))
    for module in ("configuration_evil", "modeling_evil"):
        (hostile / f"{module}.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    code, out = _rollout(tmp_path, hostile)
    assert code == 2, out
    message = _one_paragraph(out)
    assert message.startswith(f"error: rollout: {hostile}/config.json: model_type 'evil' is not one transformers "
                              "ships, and its auto_map names code in the checkpoint (configuration_evil.EvilConfig, "
                              "modeling_evil.EvilModel)"), message
    assert not marker.exists() and not (tmp_path / "r").exists()
