"""Which ops make fresh arrays and which end freshness by reading (``fresh.py``); the
cache entry that keeps a factory's warm outputs fresh."""

from __future__ import annotations

from typing import Any

from .aliases import is_view
from .fresh import mark_fresh

# the factory ops whose output is fresh (``fresh.py``); those without ``clone`` read no values
_FACTORIES = ("new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided", "zeros_like", "ones_like",
              "empty_like", "full_like", "rand_like", "randn_like", "randint_like")
_MAKES_FRESH: dict[Any, bool] = {}


def makes_fresh(func: Any) -> bool:
    """Whether ``func``'s output is fresh: a factory op, or ``clone``."""
    v = _MAKES_FRESH.get(func)
    if v is None:
        name = func.overloadpacket.__name__
        v = _MAKES_FRESH[func] = name in _FACTORIES or name in ("clone", "_lazy_clone")
    return v


_READS: dict[Any, bool] = {}


def reads_values(func: Any) -> bool:
    """Whether ``func`` reads its array inputs' values in a way that ends a fresh buffer's
    freshness: not a view, a write (judged by ``run_mutating``), a factory that takes only
    their metadata, or a copy (``clone``: the copy holds the value as it was, as torch's
    would, and the buffer may still be written; autograd copies an in-place op's input
    before the write when its formula needs it, ``x.clone().clamp_(-1, 1)`` with ``x``
    requiring grad)."""
    v = _READS.get(func)
    if v is None:
        v = _READS[func] = not (is_view(func) or func._schema.is_mutable or makes_fresh(func))
    return v


class FreshEntry:
    """A factory op's dispatch cache entry: its warm outputs are fresh too."""

    __slots__ = ("entry",)

    def __init__(self, entry: Any) -> None:
        self.entry = entry

    def warm(self, args: tuple, kwargs: dict) -> Any:
        out = self.entry.warm(args, kwargs)
        mark_fresh(out)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.entry, name)
