"""Observers of the collectives shardfn runs: the backends and ``sf.lax`` report each one here,
and tools above them (``sf.debug.CommCounter``) subscribe. A lower layer never imports the tool;
with no observer the cost is one list test per plan."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

OBSERVERS: list[Callable[[Any], None]] = []
"""Called with each communicating :class:`~shardfn.plan.Step` as it runs (in this process)."""

_quiet = threading.local()


def notify(step: Any) -> None:
    """Report ``step`` (a plan step about to run) to every observer, unless reports are muted."""
    if OBSERVERS and not getattr(_quiet, "on", False):
        for observer in tuple(OBSERVERS):
            observer(step)


@contextlib.contextmanager
def muted() -> Iterator[None]:
    """Do not report collectives run inside (traces on meta/fake values that move no data)."""
    old = getattr(_quiet, "on", False)
    _quiet.on = True
    try:
        yield
    finally:
        _quiet.on = old
