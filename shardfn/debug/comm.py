"""CommCounter: count the collectives a block issues and the bytes they move."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..plans.planner import COMM_KINDS, Step

_active: list["CommCounter"] = []


def _record(step: Step) -> None:
    if _active and step.kind in COMM_KINDS:
        for c in _active:
            c.counts[step.kind] += 1
            c.bytes += step.bytes
            c.steps.append(step)


class CommCounter:
    """Context manager counting collectives by kind (``.counts``) and the most bytes any
    device sends (``.bytes``, ring costs as in ``Plan.bytes_per_device``)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.bytes = 0
        self.steps: list[Step] = []

    @property
    def total(self) -> int:
        """Number of communicating steps."""
        return sum(self.counts.values())

    def __enter__(self) -> CommCounter:
        _active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _active.remove(self)

    def __repr__(self) -> str:
        return f"CommCounter({dict(self.counts)}, bytes={self.bytes})"
