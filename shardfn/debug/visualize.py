"""Show which device holds which global index ranges of a ShardedArray."""

from __future__ import annotations

from typing import Any

from ..values.errors import ShardingError
from ..values.layout import all_boxes, describe


def visualize_sharding(x: Any, *, file: Any = None, show: bool = True) -> str:
    """A table of which device holds which global index ranges of ``x`` (also printed)."""
    layout = getattr(x, "_layout", None)
    if layout is None:
        raise ShardingError(f"visualize_sharding(x): x is a {type(x).__name__}, not a ShardedArray (sf.distribute makes one)")
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
