"""What the layers above plug into the backends (which never import them): observers of
the collectives that run (``sf.debug.CommCounter`` subscribes; the backends and ``sf.lax``
report each one, with no observer the cost is one list test per plan) and the shard_map
runners."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

OBSERVERS: list[Callable[[Any], None]] = []
"""Called with each communicating :class:`~shardfn.plans.planner.Step` as it runs (in this process)."""

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


# backend name -> ``run(f, inputs, out_specs, check_vma, kwargs)``: how a shard_map body
# runs on that backend; registered by ``shardfn.transforms.shard_map``
SHARD_MAP_RUNNERS: dict[str, Callable[..., Any]] = {}
