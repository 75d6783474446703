"""The registries through which lower modules call code above them (which they never
import): observers of the collectives that run (``sf.debug.CommCounter`` subscribes; the
backends and ``sf.lax`` report each one, with no observer the cost is one list test per
plan), the shard_map runners of each backend, the sub-mesh collectives ``sf.lax`` routes to
a dist partial-manual body, and the public ``shard_map`` a nested simulated run calls."""

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

# (on_submesh, collective) pairs registered by ``transforms/shard_map/sub_dist.py``: an
# ``sf.lax`` collective on a value for which ``on_submesh(x)`` holds (a dist partial-manual
# body's sub-mesh array) runs as ``collective(fn, x, args, kwargs)``
SUBMESH_COLLECTIVES: list[tuple[Callable[[Any], bool], Callable[..., Any]]] = []


def register_submesh_collective(on_submesh: Callable[[Any], bool], collective: Callable[..., Any]) -> None:
    """Route ``sf.lax`` collectives on values for which ``on_submesh(x)`` holds to
    ``collective(fn, x, args, kwargs)``."""
    if (on_submesh, collective) not in SUBMESH_COLLECTIVES:
        SUBMESH_COLLECTIVES.append((on_submesh, collective))


# the public ``shard_map`` (``transforms/shard_map/api.py`` appends it): a shard_map nested
# in a simulated partial-manual run (``sub_sim.py``, below ``api``) calls it
SHARD_MAP: list[Callable[..., Any]] = []
