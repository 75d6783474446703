"""Which ops end a fresh array's freshness by reading it (``fresh.py``): every op but a
view, a write, a factory that takes only its inputs' metadata, and a copy."""

from __future__ import annotations

from typing import Any

from .aliases import is_view

# the ops that read only their inputs' metadata (factories), or copy them (``clone``): no reads
_FACTORIES = ("new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided", "zeros_like", "ones_like",
              "empty_like", "full_like", "rand_like", "randn_like", "randint_like")
_NOT_READING: dict[Any, bool] = {}


def _not_reading(func: Any) -> bool:
    """Whether ``func`` is a factory op (its inputs' metadata only) or ``clone``."""
    v = _NOT_READING.get(func)
    if v is None:
        name = func.overloadpacket.__name__
        v = _NOT_READING[func] = name in _FACTORIES or name in ("clone", "_lazy_clone")
    return v


_READS: dict[Any, bool] = {}


def reads_values(func: Any) -> bool:
    """Whether ``func`` reads its array inputs' values in a way that ends a fresh array's
    freshness: not a view, a write (judged by ``run_mutating``), a factory that takes only
    their metadata, or a copy (``clone``: the copy holds the value as it was, as torch's
    would, and the array may still be written; autograd copies an in-place op's input
    before the write when its formula needs it, ``x.clone().clamp_(-1, 1)`` with ``x``
    requiring grad)."""
    v = _READS.get(func)
    if v is None:
        v = _READS[func] = not (is_view(func) or func._schema.is_mutable or _not_reading(func))
    return v
