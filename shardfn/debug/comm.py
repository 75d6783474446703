"""CommCounter: count the collectives a block issues and the bytes they move."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..backends.hooks import OBSERVERS
from ..plans.planner import Step


class CommCounter:
    """Context manager counting collectives by kind (``.counts``) and the most bytes any
    device sends (``.bytes``, ring costs as in ``Plan.bytes_per_device``)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.bytes = 0
        self.steps: list[Step] = []

    def record(self, step: Step) -> None:
        """Count one communicating step (called by the backends while entered)."""
        self.counts[step.kind] += 1
        self.bytes += step.bytes
        self.steps.append(step)

    @property
    def total(self) -> int:
        """Number of communicating steps."""
        return sum(self.counts.values())

    def __enter__(self) -> CommCounter:
        OBSERVERS.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        OBSERVERS.remove(self)

    def __repr__(self) -> str:
        return f"CommCounter({dict(self.counts)}, bytes={self.bytes})"
