"""The catalog's tables, which each rule family fills as it is imported: a family names the
op kinds (or targets) its rules decide with `decides`, so a new family is one new file in
this folder and `autopar.sharding.catalog` needs no edit."""

from __future__ import annotations

from typing import Callable

from autopar.graph.analysis import OpKind
from autopar.sharding.rules.context import RuleContext
from autopar.sharding.strategy import Strategy

Rule = Callable[[RuleContext], Strategy]

RULES: dict[OpKind, Rule] = {}  # by op kind; a one-axis rule unless the kind is in MODE_RULES
MODE_RULES: dict[OpKind, Rule] = {}  # in a 2D, 2.5D or 3D layer: the grid rule of a kind
TARGET_RULES: dict[object, Rule] = {}  # ops the analysis leaves OpKind.OTHER, by fx target


def decides(*keys: object, grid: bool = False) -> Callable[[Rule], Rule]:
    """Make the decorated rule the catalog's entry for `keys`: op kinds (into `MODE_RULES`
    with grid=True, else `RULES`) or, for ops the analysis does not classify, fx targets
    (`TARGET_RULES`). Two rules claiming one key is an error naming both."""
    if not keys:
        raise ValueError("decides() needs at least one op kind or target")

    def register(rule: Rule) -> Rule:
        for key in keys:
            table = (MODE_RULES if grid else RULES) if isinstance(key, OpKind) else TARGET_RULES
            if grid and not isinstance(key, OpKind):
                raise ValueError(f"{_name(rule)}: grid rules are found by op kind, not by "
                                 f"target ({key})")
            held = table.get(key)
            if held is not None and held is not rule:
                raise ValueError(f"two catalog rules for {key}: {_name(held)} and "
                                 f"{_name(rule)}; give it to one of them")
            table[key] = rule
        return rule

    return register


def _name(rule: Rule) -> str:
    return f"{rule.__module__}.{rule.__qualname__}"
