"""The declarative rule table: aten op -> sharding rule.

Rules are data (see the family modules: ``pointwise``, ...); each rule object turns an
:class:`~shardfn.rules.base.OpCall` into candidate strategies that dispatch costs.
"""

from __future__ import annotations

import threading
from typing import Any

from .base import Rule

_TABLE: dict[Any, Rule] = {}
_FAMILIES = ("pointwise", "matrix", "reductions", "views", "indexing", "nn", "random_ops", "fused")
_loaded = False


_load_lock = threading.RLock()
_loading = False


def _load() -> None:
    """Fill the table once; other threads (shard_map bodies run per device) wait for it,
    a re-entrant call from the loading thread returns at once."""
    global _loaded, _loading
    if _loaded:
        return
    with _load_lock:
        if _loaded or _loading:
            return
        _loading = True
        import importlib

        for name in _FAMILIES:
            table = importlib.import_module(f"{__name__}.{name}").TABLE
            for op, rule in table.items():
                _TABLE.setdefault(op, rule)
        _loaded = True


def lookup(func: Any) -> Rule | None:
    """The rule for an op overload (an exact overload beats its overload packet)."""
    _load()
    rule = _TABLE.get(func)
    if rule is None:
        rule = _TABLE.get(func.overloadpacket)
    if rule is None and _is_pointwise(func):
        from .pointwise import POINTWISE

        rule = POINTWISE
    return rule


def register(op: Any, rule: Rule) -> None:
    """Install ``rule`` for ``op`` (overload or packet), replacing any built-in one."""
    _load()
    _TABLE[op] = rule
    from ..arrays.dispatch import _cache

    _cache.clear()


def _is_pointwise(func: Any) -> bool:
    import torch

    return torch.Tag.pointwise in func.tags and not func._schema.is_mutable
