"""Tools a model calls in an episode, and the `tools` environment that runs them.

A tool is a plain Python function with type hints and a Google-style docstring: its JSON schema
(what a chat template shows the model) comes from them (`transformers.utils.get_json_schema`).
Built in: `calculator` (exact arithmetic on integers and decimals) and `python` (model-written
code in the sandbox, `sandbox.py`, in the mode the environment's `sandbox` names). Any other
tool is named by import path, 'pkg.module:function'.

The model calls tools in the format most chat templates teach (Hermes / Qwen / Llama 3.1 JSON):

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "(3 + 4) * 2"}}
    </tool_call>

Whatever goes wrong in a call (unknown tool, malformed JSON, wrong arguments, the tool raising or
running past its timeout) becomes the tool's reply, which the model reads: an episode never
crashes the stage.
"""

from __future__ import annotations

import ast
import inspect
import json
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from rlpipe.stages.rollout.environments.base import ModelTurn, StepResult, ToolCall

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as a model writes it (what `parse_tool_calls` reads back)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def tool_response_text(content: str) -> str:
    """A tool's result as a raw-text episode shows it to the model (`TextTurns`)."""
    return f"<tool_response>\n{content}\n</tool_response>"


def parse_tool_calls(text: str) -> tuple[ToolCall, ...]:
    """The tool calls in a model turn, in order; a malformed one carries its `error`."""
    calls = []
    for raw in _CALL.findall(text):
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(name="", arguments={}, error=f"the tool call is not JSON ({e.msg} at "
                                                                f"character {e.pos}): {raw[:200]}"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(name="", arguments={}, error=f'a tool call needs {{"name": ..., "arguments": '
                                                               f'{{...}}}}, got: {raw[:200]}'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some templates emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(name=obj["name"], arguments={}, error="the tool call's arguments must be an "
                                                                        f"object, got: {json.dumps(args)[:200]}"))
            continue
        calls.append(ToolCall(name=obj["name"], arguments=args))
    return tuple(calls)


# ---- built-in tools ----------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64  # 2**64 is fine; 9**9**9 would take the process's memory
MAX_BITS = 4096  # and so would (2**64)**64)**64...: no intermediate beyond 4096 bits


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: + - * / // % ** and parentheses on integers and
    decimals.

    Args:
        expression: The expression, for example "(3 + 4) * 2" or "7 / 2".
    """

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > MAX_EXPONENT):
                raise ValueError(f"exponents must be whole numbers up to {MAX_EXPONENT}")
            out = Fraction(_BINARY[type(node.op)](left, right))
            if max(out.numerator.bit_length(), out.denominator.bit_length()) > MAX_BITS:
                raise ValueError(f"a number in it has more than {MAX_BITS} bits")
            return out
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError) as e:
        return f"error: {e.msg if isinstance(e, SyntaxError) else e}"
    if result.denominator == 1:
        return str(result.numerator)
    return f"{result.numerator}/{result.denominator} = {float(result):.10g}"


def python(code: str) -> str:
    """Run a Python program and return what it prints (standard output, then any error). No
    network access, and no files but those in its working directory; a few seconds and a few
    hundred MB at most.

    Args:
        code: The program's source code.
    """
    return python_in("strict")(code)


def python_in(sandbox: str) -> Callable[[str], str]:
    """The `python` tool running its code in the `sandbox` mode (`sandbox.py`); its only argument
    is the code, so a model cannot pick the mode."""
    from rlpipe.stages.rollout.environments.sandbox import run_python

    def run(code: str) -> str:
        return run_python(code, sandbox=sandbox).reply()

    return run


BUILTIN_TOOLS: dict[str, Callable[..., str]] = {"calculator": calculator, "python": python}


# ---- the tools environment ---------------------------------------------------------------------

@dataclass(frozen=True)
class Tool:
    """A function the model may call, with the JSON schema its chat template shows."""

    name: str
    function: Callable[..., Any]
    schema: dict[str, Any]

    @classmethod
    def named(cls, ref: str, timeout_s: float | None, sandbox: str = "strict") -> Tool:
        """A built-in tool's name or a function's import path; its calls bounded by `timeout_s`
        (the python tool's by the limits of its `sandbox` mode instead)."""
        from transformers.utils import get_json_schema

        from rlpipe.stages.common.cli import import_function
        from rlpipe.stages.score.contain import contain

        if ref not in BUILTIN_TOOLS and ":" not in ref:
            raise ValueError(f"environment.kwargs.tools: {ref!r} is not a built-in tool ({', '.join(BUILTIN_TOOLS)}) "
                             "nor an import path 'pkg.module:function'")
        fn = BUILTIN_TOOLS.get(ref) or import_function(ref, "environment.kwargs.tools")
        try:
            schema = get_json_schema(fn)
        except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
            raise ValueError(f"tool {ref!r}: {e} (a tool needs type hints and a docstring with an Args: "
                             "section describing every argument)") from None
        # Built-ins contain themselves (the python tool runs in the sandbox); user tools run in
        # this process under a timeout.
        if ref == "python":
            run = python_in(sandbox)
        else:
            run = fn if ref in BUILTIN_TOOLS else contain(fn, ref=ref, timeout_s=timeout_s, isolate=False)
        return cls(schema["function"]["name"], run, schema)

    def __call__(self, arguments: dict[str, Any]) -> str:
        try:
            inspect.signature(self.function).bind(**arguments)
        except TypeError as e:
            wanted = ", ".join(self.schema["function"]["parameters"].get("properties", {}))
            return f"error: wrong arguments for {self.name} ({e}); it takes: {wanted}"
        try:
            out = self.function(**arguments)
        except Exception as e:
            return f"error: {self.name} failed: {type(e).__name__}: {e}"
        return out if isinstance(out, str) else json.dumps(out, default=str)


class ToolsEnvironment:
    """An episode of tool use: the prompt opens it; each model turn's tool calls are run and their
    results are the environment's reply; a turn without tool calls ends it. No reward of its own
    (the score stage's components judge the final answer)."""

    def __init__(self, tools: list[Tool]):
        self.tools = {tool.name: tool for tool in tools}
        self.schemas = [tool.schema for tool in tools]

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        return list(row.get("messages") or [{"role": "user", "content": row["prompt"]}])

    def step(self, turn: ModelTurn) -> StepResult:
        if not turn.tool_calls:
            return StepResult(messages=(), done=True)
        return StepResult(messages=tuple({"role": "tool", "name": call.name, "content": self._run(call)}
                                         for call in turn.tool_calls))

    def _run(self, call: ToolCall) -> str:
        if call.error:
            return f"error: {call.error}"
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: no tool named {call.name!r}; the tools are: {', '.join(self.tools)}"
        return tool(call.arguments)


def make_tools_environment(tools: tuple[str, ...] | list[str] = ("calculator",), timeout_s: float | None = 10.0,
                           sandbox: str = "strict") -> Callable[[], ToolsEnvironment]:
    """The `tools` environment's factory: `tools` are built-in names or import paths; `sandbox`
    is the python tool's mode, 'strict' or 'rlimits_only' (`sandbox.py` says what each holds)."""
    if not tools:
        raise ValueError("environment.kwargs.tools: name at least one tool")
    if "python" in tools:
        _check_sandbox(sandbox)
    built = [Tool.named(ref, timeout_s, sandbox) for ref in tools]
    return lambda: ToolsEnvironment(built)


def _check_sandbox(sandbox: str) -> None:
    """Refuse before any episode a mode that is not one, or a strict sandbox this machine cannot
    set up: the python tool never runs model code with less containment than configured."""
    from rlpipe.stages.rollout.environments import sandbox as box

    if sandbox not in box.SANDBOX_MODES:
        raise ValueError(f"environment.kwargs.sandbox: {sandbox!r} is not a sandbox mode; choose 'strict' "
                         "(namespaces: no files outside its folder, no network) or 'rlimits_only'")
    why = box.strict_sandbox_error() if sandbox == "strict" else None
    if why:
        raise ValueError(
            f"environment.kwargs.sandbox: the python tool's strict sandbox cannot be set up on this machine ({why}). "
            "It needs mount and network namespaces: run as root with CAP_SYS_ADMIN, or allow unprivileged user "
            "namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu also "
            "kernel.apparmor_restrict_unprivileged_userns=0; in a container, a seccomp profile allowing unshare). "
            "Or set environment.kwargs.sandbox: rlimits_only to run model code under time and memory limits only, "
            "able to read and write what the run's user can (docs/design.md#multi-turn)")
