"""Debugging aids: count the communication a block issues, and show who holds what."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ._replicas import check_replicas as check_replicas
from .layout import all_boxes, describe
from .plan import COMM_KINDS, Step

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


def visualize_sharding(x: Any, *, file: Any = None, show: bool = True) -> str:
    """A table of which device holds which global index ranges of ``x`` (also printed)."""
    layout = x._layout
    shape = tuple(x.shape)
    mesh = layout.mesh
    rows = [f"{describe(shape, x.dtype, layout)} on {mesh!r}"]
    names = mesh.axis_names
    for dev, box in enumerate(all_boxes(layout, shape)):
        coords = ", ".join(f"{n}={c}" for n, c in zip(names, mesh.coords(dev)))
        ranges = ", ".join(f"{lo}:{hi}" for lo, hi in box) or "scalar"
        extra = f"  (partial {', '.join(f'{op} over {a!r}' for a, op in layout.partial)})" if layout.partial else ""
        rows.append(f"  device {dev} ({coords}): [{ranges}]{extra}")
    text = "\n".join(rows)
    if show:
        print(text, file=file)
    return text
