"""The python tool's sandbox (stages/rollout/environments/sandbox.py): its limits, its modes, the
strict mode for a non-root user, and the refusal to run with less than configured. The strict
mode from inside an episode: test_environments.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from rlpipe.stages.common.cli import stage_main
from rlpipe.stages.rollout.config import RolloutConfig
from rlpipe.stages.rollout.environments import EnvironmentSpec, ModelTurn, make_environment, sandbox
from rlpipe.stages.rollout.environments.sandbox import run_python
from rlpipe.stages.rollout.environments.tools import parse_tool_calls, tool_call_text

pytestmark = pytest.mark.multiturn

#: What the strict sandbox stops, as code and the reply that says it was stopped.
ESCAPES = {
    "print(open('/etc/passwd').read())": "No such file or directory: '/etc/passwd'",
    "open('/usr/rlpipe-sandbox-probe', 'w')": "Read-only file system: '/usr/rlpipe-sandbox-probe'",
    "import socket; socket.create_connection(('127.0.0.1', 9), timeout=2)": "Network is unreachable",
    # no privilege left to undo it: remounting /usr writable, becoming root
    "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "if libc.mount(None, b'/usr', None, ctypes.c_ulong(32 | 4096), None):  # MS_REMOUNT | MS_BIND\n"
    "    raise OSError(ctypes.get_errno(), 'remount /usr writable')": "PermissionError: [Errno 1] remount /usr",
    "import os; os.setuid(0)": "Error: [Errno ",  # EPERM as nobody; EINVAL where 0 is not mapped
}


def test_hostile_code_is_contained_and_reported(strict_sandbox):
    """Sleeps, allocates, raises, floods its output, forks: each comes back as the tool's reply
    within its limits, and the caller goes on."""
    cases = {
        "import time; time.sleep(60)": ("timeout", "the time limit"),
        "x = bytearray(4 << 30)": ("memory", "the memory limit"),
        "import socket; socket.create_connection(('10.255.255.1', 80), timeout=5)": ("error", "Network is unreachable"),
        "raise KeyError('boom')": ("error", "KeyError: 'boom'"),
        "while True: print('y' * 4096)": ("error", "File too large"),
        "import os, time\nfor _ in range(4): os.fork()\ntime.sleep(60)": ("timeout", "the time limit"),
        "print(sum(range(10)))": ("ok", "45"),
    }
    started = time.perf_counter()
    for code, (status, said) in cases.items():
        result = run_python(code, timeout_s=2.0, memory_mb=256, max_file_mb=1)
        assert (result.status, result.isolation) == (status, "strict"), (code, result)
        assert said in result.reply(), (code, result.reply())
    assert time.perf_counter() - started < 30  # two 2 s timeouts and quick failures


def test_the_strict_sandbox_stops_each_escape(strict_sandbox):
    for code, said in ESCAPES.items():
        result = run_python(code)
        assert (result.status, result.isolation) == ("error", "strict") and said in result.reply(), result


def test_a_non_root_user_gets_the_strict_sandbox_through_a_user_namespace(tmp_path):
    """The path a laptop takes: run as nobody (setpriv, the system's python3), the sandbox maps
    that uid into a user namespace of its own and stops the same escapes."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0:
        pytest.skip("not root: the other tests of the strict sandbox run this path already")
    assert python and shutil.which("setpriv"), "needs /usr/bin/python3 and setpriv (util-linux)"
    # sandbox.py and its child where nobody can read them (the checkout may be in root's home)
    where = Path(tempfile.mkdtemp())
    try:
        where.chmod(0o755)
        for name in ("sandbox.py", "sandbox_child.py"):
            shutil.copy(Path(sandbox.__file__).with_name(name), where / name)
        script = ("import importlib.util, json, sys\n"
                  "spec = importlib.util.spec_from_file_location('box', sys.argv[1])\n"
                  "box = sys.modules['box'] = importlib.util.module_from_spec(spec)\n"
                  "spec.loader.exec_module(box)\n"
                  "for code in json.loads(sys.argv[2]):\n"
                  "    r = box.run_python(code)\n"
                  "    print(json.dumps([r.status, r.isolation, r.reply()]))\n")
        codes = ["import os; print(os.getuid())", *ESCAPES]
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", script,
                               str(where / "sandbox.py"), json.dumps(codes)], cwd="/", capture_output=True, text=True,
                              timeout=120)
    finally:
        shutil.rmtree(where)
    assert proc.returncode == 0, proc.stderr
    (status, isolation, uid), *escapes = map(json.loads, proc.stdout.splitlines())
    assert (status, isolation, uid) == ("ok", "strict", "65534")
    for (status, isolation, reply), said in zip(escapes, ESCAPES.values(), strict=True):
        assert (status, isolation) == ("error", "strict") and said in reply, reply


def test_a_failed_setup_runs_no_code(tmp_path):
    """Any step of the strict setup failing (here: no folder to build the new root in) stops the
    process before the code, and says why."""
    (tmp_path / "work").mkdir()
    (tmp_path / "main.py").write_text("open('ran', 'w').write('yes')")
    child = Path(sandbox.__file__).with_name("sandbox_child.py")
    proc = subprocess.run([sys.executable, "-I", str(child), str(tmp_path), "strict", *["0"] * 5],
                          cwd=tmp_path / "work", capture_output=True, timeout=60)
    assert proc.returncode == 125
    assert (tmp_path / "isolation").read_text().startswith("failed: [Errno 2] mount tmpfs on ")
    assert not (tmp_path / "work" / "ran").exists()


def _python_tool(**kwargs):
    return make_environment(EnvironmentSpec(name="tools", kwargs={"tools": ["python"], **kwargs}))


def test_a_machine_without_namespaces_is_refused_unless_rlimits_only_is_configured(monkeypatch, tmp_path):
    why = "[Errno 1] unshare(user, mount, network namespaces): Operation not permitted"
    monkeypatch.setattr(sandbox, "strict_sandbox_error", lambda: why)
    with pytest.raises(ValueError) as refused:
        _python_tool()
    assert str(refused.value).startswith("environment.kwargs.sandbox: the python tool's strict sandbox cannot be "
                                         f"set up on this machine ({why}).")
    assert "set environment.kwargs.sandbox: rlimits_only" in str(refused.value)
    with pytest.raises(ValueError, match="environment.kwargs.sandbox: 'loose' is not a sandbox mode"):
        _python_tool(sandbox="loose")
    make_environment(EnvironmentSpec(name="tools", kwargs={"tools": ["calculator"]}))  # no python tool: no check
    # configured: it runs, with what the mode does not prevent (reading the run's files)
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cr3t-value")
    env = _python_tool(sandbox="rlimits_only")()
    text = tool_call_text("python", {"code": f"print(open({str(secret)!r}).read())"})
    [reply] = env.step(ModelTurn(text, parse_tool_calls(text))).messages
    assert reply["content"] == "s3cr3t-value"


def test_the_rollout_stage_refuses_it_with_one_error_line(monkeypatch, tiny_policy_dir, prompts_dir, tmp_path,
                                                           capsys):
    monkeypatch.setattr(sandbox, "strict_sandbox_error", lambda: "unshare: Operation not permitted")
    cfg = RolloutConfig(checkpoint=tiny_policy_dir, prompts=prompts_dir, output=tmp_path / "out",
                        environment={"name": "tools", "kwargs": {"tools": ["python"]}})
    path = tmp_path / "rollout.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    code = stage_main("rollout", ["-c", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    [line] = err.strip().splitlines()
    assert line.startswith("error: rollout: environment.kwargs.sandbox: the python tool's strict sandbox cannot "
                           "be set up on this machine (unshare: Operation not permitted)"), line
    assert not (tmp_path / "out").exists()
