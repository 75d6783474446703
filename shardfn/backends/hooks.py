"""What the layers above plug into the backends (which never import them): observers of
the communication that runs (``sf.debug.CommCounter``) and the shard_map runners."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..plans.planner import COMM_KINDS, Step


class CommObserver(Protocol):
    def record(self, step: Step) -> None:
        """Note one communicating step."""


OBSERVERS: list[CommObserver] = []  # entered observers, innermost last


def record(step: Step) -> None:
    """Show ``step`` (a plan step, or an ``sf.lax`` collective) to every entered observer
    if it communicates."""
    if OBSERVERS and step.kind in COMM_KINDS:
        for o in OBSERVERS:
            o.record(step)


# backend name -> ``run(f, inputs, out_specs, check_vma, kwargs)``: how a shard_map body
# runs on that backend; registered by ``shardfn.transforms.shard_map``
SHARD_MAP_RUNNERS: dict[str, Callable[..., Any]] = {}
