"""The abstract sharded value: ``ShardedArray`` registers as one, so the layers below
arrays (backends) can recognise it without importing it."""

from __future__ import annotations

import abc


class Sharded(abc.ABC):  # noqa: B024 - a marker: classes register, nothing to implement
    """A tensor laid out over a mesh (``isinstance(x, Sharded)`` for a ShardedArray)."""
