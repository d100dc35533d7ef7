"""Group predicates of the filter stage and their registry.

A predicate `fn(rewards, **knobs) -> bool` sees one group's sampled rewards and returns True to
drop the group. Each is registered with `@register_predicate(<variant>)`, the config class in
config.py whose fields (but `name`) are exactly its keyword knobs; `drops(config, rewards)`
dispatches on the variant's `name`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from rlpipe.schemas.config import Variant
from rlpipe.stages.common.cli import import_function
from rlpipe.stages.filter.config import AllEqualPredicate, CustomPredicate, PredicateConfig

GroupPredicate = Callable[..., bool]
GROUP_PREDICATES: dict[str, tuple[type, GroupPredicate]] = {}
"""name -> (config variant, predicate `fn(rewards, **knobs)`)."""


def register_predicate(config: type[Variant]) -> Callable[[GroupPredicate], GroupPredicate]:
    """Register a predicate under its config variant's name; the variant's fields (but `name`)
    must be the function's keyword parameters. Registering a name twice raises."""
    def deco(fn: GroupPredicate) -> GroupPredicate:
        name = config.check_function(fn, GROUP_PREDICATES, "group predicate")
        GROUP_PREDICATES[name] = (config, fn)
        return fn

    return deco


def drops(predicate: PredicateConfig, rewards: Sequence[float]) -> bool:
    """Whether `predicate` (name and knobs) drops the group whose sampled rewards are `rewards`."""
    try:
        _, fn = GROUP_PREDICATES[predicate.name]
    except KeyError:
        raise ValueError(f"unknown group predicate {predicate.name!r}; known: {sorted(GROUP_PREDICATES)}") from None
    return fn(list(rewards), **predicate.knobs())


@register_predicate(AllEqualPredicate)
def all_equal(rewards: list[float]) -> bool:
    """True when every reward equals every other (exactly: max == min), or the group has one sample."""
    return len(rewards) < 2 or max(rewards) == min(rewards)


@register_predicate(CustomPredicate)
def custom(rewards: list[float], *, function: str, kwargs: dict) -> bool:
    """A user predicate `fn(rewards, **kwargs) -> bool` (True drops the group)."""
    fn = import_function(function, "drop.function")
    out = fn(rewards, **kwargs)
    if not isinstance(out, bool | np.bool_):
        raise ValueError(f"drop.function {function!r} returned {type(out).__name__}; expected a bool "
                         "(True drops the group)")
    return bool(out)
