"""Functions torch.compile records as one call: shard_map/local_map make them at run time,
before or after Dynamo is loaded; ``shardfn.compile`` installs the marker once it is."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

_pending: weakref.WeakSet = weakref.WeakSet()  # made before the marker was installed
_mark: Callable[[Callable], object] | None = None


def in_graph(fn: F) -> F:
    """Mark a function made at run time (e.g. by shard_map) as one graph call."""
    if _mark is not None:
        _mark(fn)
    else:
        _pending.add(fn)
    return fn


def install(mark: Callable[[Callable], object]) -> None:
    """Use ``mark`` (Dynamo's ``allow_in_graph``) from now on, and on every function made so far."""
    global _mark
    _mark = mark
    for fn in list(_pending):
        mark(fn)
    _pending.clear()
