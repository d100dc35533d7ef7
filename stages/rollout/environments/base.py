"""The environment interface of multi-turn episodes.

An environment is made per episode by a factory (`environment.function`, 'pkg.module:make', or
a built-in `environment.name`) called with `environment.kwargs`; the factory it returns is called
once per episode. `reset(row)` takes the prompt row (its `prompt`, `messages`, `answer` and
`metadata`) and returns the opening messages; each `step(turn)` takes the model's turn (its text
and parsed tool calls) and returns the environment's reply messages, an optional reward and
whether the episode is over. An episode also ends after `max_turns` model turns.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator


@dataclass(frozen=True)
class ToolCall:
    """One tool call parsed from a model turn; `error` says why a malformed one could not be."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


@dataclass(frozen=True)
class ModelTurn:
    """What the model said in one turn."""

    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str = "stop"  # 'stop' or 'length' (the turn ran out of tokens)


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to a model turn."""

    messages: tuple[dict[str, Any], ...] = ()
    reward: float | None = None
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]: ...

    def step(self, turn: ModelTurn) -> StepResult: ...


#: Built-in environments: name -> the import path of their factory's maker.
BUILTIN_ENVIRONMENTS = {"tools": "rlpipe.stages.rollout.environments.tools:make_tools_environment"}


class EnvironmentSpec(BaseModel):
    """`rollout.environment`: which environment answers the model, and for how many turns."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    name: str | None = None
    """A built-in environment: 'tools' (kwargs: tools, a list of built-in tool names
    ('calculator', 'python') or 'pkg.module:function' paths; timeout_s per call; sandbox, the
    python tool's: 'strict' (default: namespaces) or 'rlimits_only' (limits only))."""
    function: str | None = None
    """Or your own: 'pkg.module:make', called with `kwargs`, returning a per-episode factory."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the factory."""
    max_turns: int = Field(4, ge=1)
    """Model turns per episode at most."""

    @model_validator(mode="after")
    def _one_source(self) -> EnvironmentSpec:
        if (self.name is None) == (self.function is None):
            raise ValueError("environment: give exactly one of name (built-in: "
                             f"{', '.join(BUILTIN_ENVIRONMENTS)}) or function ('pkg.module:make')")
        if self.name is not None and self.name not in BUILTIN_ENVIRONMENTS:
            raise ValueError(f"environment.name {self.name!r} is not built in; built in: "
                             f"{', '.join(BUILTIN_ENVIRONMENTS)} (or give function: 'pkg.module:make')")
        return self


def make_environment(spec: EnvironmentSpec) -> Callable[[], Environment]:
    """The per-episode factory `spec` names (tools, import paths and kwargs checked now)."""
    from rlpipe.stages.common.cli import import_function

    ref = BUILTIN_ENVIRONMENTS[spec.name] if spec.name else spec.function
    make = import_function(ref, "environment.function")
    try:
        inspect.signature(make).bind(**spec.kwargs)
    except TypeError as e:
        raise ValueError(f"environment.kwargs do not fit {spec.name or spec.function}: {e}") from None
    factory = make(**spec.kwargs)
    if not callable(factory):
        raise ValueError(f"environment {spec.name or spec.function} returned a {type(factory).__name__}, "
                         "not a per-episode factory")
    return factory
