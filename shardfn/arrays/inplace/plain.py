"""In-place and ``out=`` writes into plain tensors: the ShardedArray inputs gathered to full
values, the op run as torch runs it."""

from __future__ import annotations

import functools
import warnings
from typing import Any

from ..array import ShardedArray
from ..redistribute import raw_full
from ...values.errors import FallbackWarning
from ...values.schema import op_name

_warned_plain: set[str] = set()  # ops warned about once (``into_plain``)


def into_plain(func: Any, args: tuple, kwargs: dict) -> Any:
    """An op writing only plain tensors: its ShardedArray inputs as full plain values (a
    plain tensor can hold nothing else), the op run as torch runs it."""
    name = op_name(func)
    if name not in _warned_plain and not _all_replicated((*args, *kwargs.values())):  # (a replica is no gather)
        _warned_plain.add(name)
        warnings.warn(f"{name} writes a plain tensor: its ShardedArray inputs are gathered to full tensors "
                      "(the out-of-place form keeps the result sharded)",
                      FallbackWarning, stacklevel=5)
    full = functools.partial(_full_values, memo={})
    return func(*(full(a) for a in args), **{k: full(v) for k, v in kwargs.items()})


def _all_replicated(vs: Any) -> bool:
    """Whether every ShardedArray among ``vs`` (and in lists) is replicated, nothing pending."""
    for v in vs:
        if isinstance(v, (list, tuple)):
            if not _all_replicated(v):
                return False
        elif isinstance(v, ShardedArray) and not v._layout.is_replicated():
            return False
    return True


def _full_values(v: Any, memo: dict) -> Any:
    """``v`` with each ShardedArray (also in lists) gathered to its full value, once per array."""
    if isinstance(v, (list, tuple)):
        return type(v)(_full_values(b, memo) for b in v)
    if not isinstance(v, ShardedArray):
        return v
    if id(v) not in memo:
        memo[id(v)] = raw_full(v)
    return memo[id(v)]
