"""The rule table the dispatcher consults: aten op -> sharding rule, and the ops it runs by
hand. ``import shardfn`` fills it (``rules/builtin.py``, ``random/torch_ops.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .strategies import Rule

_TABLE: dict[Any, Rule] = {}
# ops dispatch runs by hand instead of by a rule (aliases, comparisons, class-sharded
# losses, random ops): ``handler(func, args, kwargs)``, ``NotImplemented`` for the rule
SPECIAL: dict[Any, Callable] = {}
_pointwise: list[Rule] = []  # the rule of an op tagged pointwise that has none of its own
_on_change: list[Callable[[], None]] = []  # called when a rule is replaced (dispatch drops its cache)


def lookup(func: Any) -> Rule | None:
    """The rule for an op overload (an exact overload beats its overload packet)."""
    rule = _TABLE.get(func)
    if rule is None:
        rule = _TABLE.get(func.overloadpacket)
    if rule is None and _pointwise and _is_pointwise(func):
        rule = _pointwise[0]
    return rule


def install(table: dict[Any, Rule]) -> None:
    """Add built-in rules; an op that already has one (a registered rule) keeps it."""
    for op, rule in table.items():
        _TABLE.setdefault(op, rule)


def set_pointwise_rule(rule: Rule) -> None:
    """The rule for pointwise-tagged ops without an entry of their own."""
    _pointwise[:] = [rule]


def register(op: Any, rule: Rule) -> None:
    """Install ``rule`` for ``op`` (overload or packet), replacing any built-in one."""
    _TABLE[op] = rule
    for fn in _on_change:
        fn()


def on_change(fn: Callable[[], None]) -> None:
    """Call ``fn`` whenever :func:`register` replaces a rule."""
    _on_change.append(fn)


def _is_pointwise(func: Any) -> bool:
    return torch.Tag.pointwise in func.tags and not func._schema.is_mutable
