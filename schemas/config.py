"""Typed configs: pydantic v2 models, frozen and strict (read from YAML and command-line overrides,
with readable errors, by `schemas/config_files.py`).

Every stage has one config model deriving from `StageConfig`. The same model is the CLI config,
the Prefect flow parameter and what the manifest records; it is never changed at runtime.
Field docs are attribute docstrings (shown by `--help` and recorded in the schema of the model).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)


@dataclass(frozen=True)
class Input:
    """Marks a config field as an input artifact: `rollouts: Annotated[Path, Input("rollouts")]`.

    `kind` is a schema name (`rollouts`, `scores`, ...) or `checkpoint` (a Hugging Face directory).
    The pipeline fills these fields, never the preset; the stage's cache key hashes their content.
    """

    kind: str


@dataclass(frozen=True)
class Output:
    """Marks a config field as an output artifact the stage writes (kind as for `Input`).

    `background`: the stage may return before this output is complete (it is written in the
    background while the next stages run: optimize's train state). It is part of the stage's
    cache hit like any output, but a launch is complete without it (`outputs_complete_on_return`);
    the stage that reads it next waits for it in the process that writes it."""

    kind: str
    background: bool = False


@dataclass(frozen=True)
class Runtime:
    """Marks a field that says how the work runs, not what it computes (how models are loaded):
    left out of the cache key, as the device and thread count are."""


@dataclass(frozen=True)
class Assigned:
    """Marks a field the pipeline sets on every call (run name, iteration, worker split), never
    the preset."""


@functools.cache
def _marked(cls: type[BaseModel], marker: type) -> dict[str, Any]:
    """Field name -> its `marker` annotation, for the fields of `cls` that carry one (a class's
    fields are fixed once it is made: found once per class; the dict is shared, not to be changed)."""
    return {name: m for name, info in cls.model_fields.items() for m in info.metadata if isinstance(m, marker)}


def _without_runtime(model: BaseModel, dumped: dict[str, Any]) -> dict[str, Any]:
    """`dumped` (`model`'s JSON dump, or part of it) less the `Runtime` fields of `model` and of the
    models nested in it (a score component's batching): what they say is how the work runs, at any
    depth."""
    out = {k: v for k, v in dumped.items() if k not in _marked(type(model), Runtime)}
    for name, value in vars(model).items():
        if name not in out:
            continue
        if isinstance(value, BaseModel):
            out[name] = _without_runtime(value, out[name])
        elif isinstance(value, (list, tuple)) and all(isinstance(v, BaseModel) for v in value):
            out[name] = [_without_runtime(v, d) for v, d in zip(value, out[name], strict=True)]
    return out




# ---------------------------------------------------------------------------------------------
# Named variants: a config knob that picks one of several algorithms, each with its own knobs
# ---------------------------------------------------------------------------------------------
class Variant(BaseModel):
    """One variant of a union tagged by `name` (`{name: gae, lam: 0.9}`); its fields are its knobs.

    A union of variants is written `Annotated[A | B, Field(discriminator="name"),
    BeforeValidator(name_shorthand)]`, so a bare string is accepted for `{name: <string>}`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    def knobs(self) -> dict[str, Any]:
        """The variant's knobs (every field but `name`), as keyword arguments of its function."""
        return {k: getattr(self, k) for k in type(self).model_fields if k != "name"}

    @classmethod
    def check_function(cls, fn: Any, registry: Mapping[str, Any], what: str) -> str:
        """The variant's name, once `fn` may be registered under it in `registry`: the name is
        new and `fn`'s keyword-only parameters are exactly the variant's knobs (so the config
        class is the one list of them)."""
        import inspect

        name = cls.model_fields["name"].default
        if name in registry:
            raise ValueError(f"{what} {name!r} is already registered")
        knobs = set(cls.model_fields) - {"name"}
        params = {p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}
        if params != knobs:
            raise TypeError(f"{fn.__qualname__} takes keywords {sorted(params)} but {cls.__name__} "
                            f"has knobs {sorted(knobs)}")
        return name


def name_shorthand(value: Any) -> Any:
    """Before-validator of a union tagged by `name`: the string `rloo` stands for `{name: rloo}`."""
    return {"name": value} if isinstance(value, str) else value


ImportRef = Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")]
"""A user function's import path, 'package.module:function' (imported when it is first needed)."""


def list_item_name(field: str, index: int) -> str:
    """The name of item `index` of a list input `field` in `StageConfig.inputs()`: `field[index]`."""
    return f"{field}[{index}]"


def split_list_item(name: str) -> tuple[str, int | None]:
    """(field, index) of an `inputs()` name: `replay[2]` -> ('replay', 2), `policy` -> ('policy', None)."""
    field, bracket, rest = name.partition("[")
    return field, int(rest[:-1]) if bracket else None


class StageConfig(BaseModel):
    """Base of every config: immutable, unknown keys rejected, field docs from docstrings.

    A stage config declares its inputs and outputs once, with `Input` / `Output` markers on the
    path fields; the pipeline, the cache keys, the launchers and the preset checks read them.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    def resolved(self) -> dict[str, Any]:
        """JSON-able dict of every field, defaults included: what manifests record."""
        return self.model_dump(mode="json")

    def cache_dict(self) -> dict[str, Any]:
        """What decides the work, for the cache key: the resolved config without its input and
        output paths (inputs enter the key by content hash; where the output goes changes
        nothing), so a copied or moved run directory reruns as cache hits, and without its
        `Runtime` fields."""
        io = {*self.input_fields(), *self.output_fields()}
        return _without_runtime(self, {k: v for k, v in self.resolved().items() if k not in io})

    @classmethod
    def input_fields(cls) -> dict[str, Input]:
        """Field name -> Input marker, for every input artifact the config can name."""
        return _marked(cls, Input)

    @classmethod
    def output_fields(cls) -> dict[str, Output]:
        """Field name -> Output marker, for every artifact the stage can write."""
        return _marked(cls, Output)

    @classmethod
    def pipeline_fields(cls) -> set[str]:
        """Fields the pipeline sets on every call (inputs, outputs, assigned): never in a preset."""
        return {*cls.input_fields(), *cls.output_fields(), *_marked(cls, Assigned)}

    def inputs(self) -> dict[str, Path]:
        """The input artifacts this config names (unset optional inputs left out); the items of a
        list input `field: list[Path]` as `field[0]`, `field[1]`, ..."""
        out: dict[str, Path] = {}
        for name in self.input_fields():
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                out.update({list_item_name(name, i): path for i, path in enumerate(value)})
            elif value is not None:
                out[name] = value
        return out

    @classmethod
    def input_kind(cls, name: str) -> str:
        """The kind of the input `name`, a key of `inputs()` (a field, or a list input's `field[i]`)."""
        return cls.input_fields()[split_list_item(name)[0]].kind

    def outputs(self) -> dict[str, Path]:
        """The artifacts this config writes (unset optional outputs left out)."""
        return {name: getattr(self, name) for name in self.output_fields() if getattr(self, name) is not None}

    def outputs_complete_on_return(self) -> dict[str, Path]:
        """The outputs complete when the stage returns (all but the `background` ones): those a
        launch waits to see written (their manifests) before the call counts as complete."""
        return {name: path for name, path in self.outputs().items() if not self.output_fields()[name].background}

    @model_validator(mode="after")
    def _outputs_apart_from_inputs(self) -> StageConfig:
        # A stage clears its output before writing it: an output equal to, inside or around an
        # input would destroy that input, and two equal outputs would overwrite each other.
        # (Absolute normalised strings: a config is validated on every load, in every order a
        # resident worker takes; pathlib's parents cost milliseconds there.)
        ins = {name: os.path.abspath(p) for name, p in self.inputs().items()}
        outs = {name: os.path.abspath(p) for name, p in self.outputs().items()}
        for o_name, o in outs.items():
            for i_name, i in ins.items():
                if _same_or_nested(o, i):
                    raise ValueError(f"output {o_name!r} ({self.outputs()[o_name]}) overlaps input {i_name!r} "
                                     f"({self.inputs()[i_name]}): a stage never writes over its inputs; "
                                     "choose another output path")
            for other_name, other in outs.items():
                if other_name < o_name and other == o:
                    raise ValueError(f"outputs {other_name!r} and {o_name!r} are the same path "
                                     f"({self.outputs()[o_name]})")
        return self
    @field_validator("*", mode="before")
    @classmethod
    def _default_variant_name(cls, value: Any, info: ValidationInfo) -> Any:
        """A mapping without `name` for a field whose default is a named variant keeps the default's
        name: `loss.eps_high=0.28` alone tunes the default loss."""
        default = cls.model_fields[info.field_name].default if info.field_name else None
        if isinstance(default, Variant) and isinstance(value, Mapping) and "name" not in value:
            return {"name": default.name, **value}
        return value


def _same_or_nested(a: str, b: str) -> bool:
    """Whether absolute normalised paths `a` and `b` are one path, or one lies inside the other."""
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep) or b.startswith(a.rstrip(os.sep) + os.sep)
