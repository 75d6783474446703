"""Checked replicas (a debug mode): while it is on, the dist backend verifies that values
claimed replicated agree across ranks -- tensors passed to ``sf.distribute`` (and plain
shard_map arguments), plain tensors mixed into ops with ShardedArrays, replicated shards
passed to ``from_local`` -- and raises a ShardingError on every rank naming the op, the
argument and the ranks that differ. Off by default (values are trusted, as in JAX): each
check is one small all_gather of a fingerprint per value.

On with ``sf.debug.check_replicas()`` (a context manager and decorator; contexts nest,
``check_replicas(False)`` turns it off inside) or the environment variable
``SHARDFN_CHECK_REPLICAS=1`` (read at each check)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from .context import ThreadStack

ENV = "SHARDFN_CHECK_REPLICAS"

_modes = ThreadStack()


def checking() -> bool:
    """Whether replicas are checked here and now (innermost context, else the environment)."""
    modes = _modes.items
    if modes:
        return modes[-1]
    return os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


@contextlib.contextmanager
def check_replicas(enabled: bool = True) -> Iterator[None]:
    """Check, on the dist backend, that values claimed replicated agree across ranks (see
    the module docstring); a mismatch is a ShardingError on every rank naming the op, the
    argument and the ranks. Usable as ``with sf.debug.check_replicas():`` or as a decorator."""
    _modes.items.append(bool(enabled))
    try:
        yield
    finally:
        _modes.items.pop()
