"""Reading configs: YAML files and command-line overrides merged, validated into a stage's typed
config (`schemas/config.py`) with errors that name the key, the file and what is allowed, and the
fields of a config described for `--help`.
"""

from __future__ import annotations

import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from rlpipe.schemas.config import name_shorthand
from rlpipe.schemas.errors import UserError
from rlpipe.schemas.inputs import hub_reference

C = TypeVar("C", bound=BaseModel)


def union_tags(union: Any, discriminator: str = "name") -> dict[str, type[BaseModel]]:
    """tag -> variant class of a union tagged by `discriminator` (an `Annotated` union or a bare one)."""
    if typing.get_origin(union) is Annotated:
        union = typing.get_args(union)[0]
    out = {}
    for variant in typing.get_args(union):
        for tag in typing.get_args(variant.model_fields[discriminator].annotation):
            out[tag] = variant
    return out


def _discriminator(field: Any) -> tuple[Any, str | None]:
    """(type, discriminator) of a field annotation or an `Annotated[...]` list item."""
    if isinstance(field, FieldInfo):
        return field.annotation, field.discriminator if isinstance(field.discriminator, str) else None
    if typing.get_origin(field) is Annotated:
        inner, *meta = typing.get_args(field)
        disc = next((m.discriminator for m in meta if isinstance(m, FieldInfo) and isinstance(m.discriminator, str)), None)
        return inner, disc
    return field, None


def _walk(cls: type[BaseModel], loc: Sequence[str | int]) -> tuple[list[str | int], Any]:
    """An error location with the variant tags pydantic inserts left out, and the type at its end.

    pydantic locates an error in a tagged union as ('estimator', 'gae', 'lam'); users wrote
    `estimator.lam`, so the tag 'gae' is dropped from the key the message names.
    """
    node: Any = cls
    disc: str | None = None
    out: list[str | int] = []
    for part in loc:
        if disc is not None and isinstance(part, str) and part in (tags := union_tags(node, disc)):
            node, disc = tags[part], None  # the tag pydantic inserted: not a key the user wrote
            continue
        out.append(part)
        if isinstance(node, type) and issubclass(node, BaseModel) and part in node.model_fields:
            node, disc = _discriminator(node.model_fields[part])
        elif isinstance(part, int) and typing.get_origin(node) in (list, tuple) and typing.get_args(node):
            node, disc = _discriminator(typing.get_args(node)[0])
        else:
            node, disc = None, None
    return out, node


class ConfigError(UserError, ValueError):
    """A config could not be loaded; the message names each bad key and what it allows."""


def _fields_at(cls: type[BaseModel], loc: Sequence[str | int]) -> list[str] | None:
    """The field names of the (nested) model at `loc` (the error's location minus its last part)."""
    model = _walk(cls, loc)[1]
    if isinstance(model, type) and issubclass(model, BaseModel):
        return sorted(model.model_fields)
    return None


def _describe(cls: type[BaseModel], err: Mapping[str, Any]) -> str:
    loc = list(err["loc"])
    key = ".".join(str(p) for p in _walk(cls, loc)[0]) or "<root>"
    if err["type"] == "extra_forbidden":
        from rlpipe.schemas.trl_names import trl_hint

        if (said := trl_hint(key)) is not None:  # a name the user brought from TRL: where it lives here
            return f"unknown key {key!r}: {said}"
        allowed = _fields_at(cls, loc[:-1])
        hint = f"; allowed keys: {', '.join(allowed)}" if allowed else ""
        return f"unknown key {key!r}{hint}"
    if err["type"] == "missing":
        return f"missing required key {key!r}"
    got = err.get("input")
    return f"key {key!r}: {err['msg']} (got {got!r})"


def parse_config(cls: type[C], data: Mapping[str, Any], source: str = "config") -> C:
    """Validate `data` into `cls`; raises ConfigError listing every problem by key."""
    try:
        return cls.model_validate(dict(data))
    except ValidationError as e:
        lines = "\n".join(f"  - {_describe(cls, err)}" for err in e.errors())
        raise ConfigError(f"invalid {cls.__name__} in {source}:\n{lines}") from None


#: libyaml's safe loader where PyYAML was built with it (the same documents, ~10x faster: a
#: resident worker reads its stage's saved config for every order), else the pure-Python one.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(path: Path | str) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.load(path.read_text(), Loader=SAFE_LOADER)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values, got {type(data).__name__}")
    return data


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `dotted.key=value` overrides; values are parsed as YAML (`3`, `true`, `[1, 2]`)."""
    out: dict[str, Any] = _deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if isinstance(child, str):  # `estimator: gae` then `estimator.lam=0.9`: {name: gae, lam: 0.9}
                child = name_shorthand(child)
                node[part] = child
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return out


def _deepcopy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deepcopy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def load_config(
    cls: type[C], path: Path | str | None = None, overrides: Sequence[str] = (),
    base: Mapping[str, Any] | None = None,
) -> C:
    """Build a config from `base`, then a YAML file, then `key=value` overrides (later wins).

    A relative path written in the YAML file is relative to the file's folder (so a run's saved
    `configs/<stage>.yaml` works from any directory and after the run folder is moved); a relative
    path given as an override is relative to the current directory.

    A file loaded again unchanged (same inode, size and modification time, same overrides and
    current directory) gives the config parsed the first time: a resident worker reads its order's
    config more than once, and a config is frozen.
    """
    try:
        stat = os.stat(path) if path is not None and base is None else None
    except OSError:
        stat = None  # (not there: the load says so, as a ConfigError)
    if stat is None:
        return _load_config(cls, path, overrides, base)
    key = (cls, os.path.abspath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns, tuple(overrides), os.getcwd())
    if (hit := _LOADED.get(key)) is None:
        hit = _LOADED[key] = _load_config(cls, path, overrides, base)
        while len(_LOADED) > _LOADED_KEPT:
            del _LOADED[next(iter(_LOADED))]
    return hit


_LOADED: dict[tuple, Any] = {}
_LOADED_KEPT = 16  # the configs of the last few orders; older ones are not asked for again


def _load_config(cls: type[C], path: Path | str | None, overrides: Sequence[str],
                 base: Mapping[str, Any] | None) -> C:
    data: dict[str, Any] = _deepcopy(base or {})
    from_file: dict[str, Any] = {}
    if path is not None:
        from_file = load_yaml(path)
        data = _merge(data, from_file)
    data = apply_overrides(data, overrides)
    source = str(path) if path is not None else "overrides"
    config = parse_config(cls, data, source)
    if path is None:
        return config
    folder = Path(path).parent
    hub_inputs = {name for name, marker in cls.input_fields().items() if marker.kind in ("checkpoint", "file")}

    def rebase(loc: tuple[str | int, ...], value: Path) -> Path:
        written = _at(from_file, loc)
        came_from_file = written is not None and str(written) == str(value) and _at(data, loc) == written
        if not came_from_file or value.is_absolute():
            return value
        rebased = Path(os.path.normpath(folder / value))
        # a Hub id written in the file for what may be one (a checkpoint, a data file to import:
        # org/name[@revision]) stays one unless the file's folder holds such a path
        hub = loc[0] in hub_inputs or (loc[0] == "components" and loc[-1] == "checkpoint")
        return value if hub and not rebased.exists() and hub_reference(value) is not None else rebased

    # Validate again: checks that compare paths (an output apart from the inputs) see the real ones.
    return parse_config(cls, map_paths(config, rebase).model_dump(), source)


def map_paths(model: C, fn: Any, loc: tuple[str | int, ...] = ()) -> C:
    """A copy of `model` with every Path field value v (nested models and lists included)
    replaced by fn(location, v)."""
    update: dict[str, Any] = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        new = _map_value(value, fn, (*loc, name))
        if new is not value:
            update[name] = new
    return model.model_copy(update=update) if update else model


def _map_value(value: Any, fn: Any, loc: tuple[str | int, ...]) -> Any:
    if isinstance(value, Path):
        return fn(loc, value)
    if isinstance(value, BaseModel):
        return map_paths(value, fn, loc)
    if isinstance(value, (list, tuple)):
        new = [_map_value(v, fn, (*loc, i)) for i, v in enumerate(value)]
        return value if all(a is b for a, b in zip(new, value, strict=True)) else type(value)(new)
    return value


def _at(data: Any, loc: Sequence[str | int]) -> Any:
    """data[loc[0]][loc[1]]...; None where the location does not exist."""
    for part in loc:
        if isinstance(data, Mapping) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and part < len(data):
            data = data[part]
        else:
            return None
    return data


def _merge(a: dict[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def describe_fields(cls: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) rows for every field, nested models flattened with dots."""
    rows = []
    for name, info in cls.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(describe_fields(ann, f"{prefix}{name}."))
            continue
        union, disc = _discriminator(info)
        if disc is not None and typing.get_origin(union) in (typing.Union, types.UnionType):
            # A tagged union: the key names the variant; each variant's knobs follow, marked by tag.
            tags = union_tags(union, disc)
            default = info.get_default(call_default_factory=True)
            shown = "required" if info.is_required() else repr(getattr(default, disc, default))
            rows.append((f"{prefix}{name}", " | ".join(tags), shown, info.description or ""))
            for tag, variant in tags.items():
                rows.extend((k, t, d, f"[{disc}={tag}] {doc}")
                            for k, t, d, doc in describe_fields(variant, f"{prefix}{name}.") if k != f"{prefix}{name}.{disc}")
            continue
        default = "required" if info.is_required() else repr(info.get_default(call_default_factory=True))
        type_name = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
        rows.append((f"{prefix}{name}", type_name, default, info.description or ""))
    return rows
