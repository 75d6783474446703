"""Layout: the canonical form of a sharding, and the pure index math of uneven shards.

A dim of size n split k ways gives piece i the range [i*c, min((i+1)*c, n)) with
c = ceil(n/k); a dim sharded over several axes is split by the first, then each piece
by the next. Devices are numbered row-major over the mesh shape.
"""

from __future__ import annotations

import functools
import math

import attrs
import torch

from .torch_compat import ValueMeta
from .mesh import Mesh

REDUCE_OPS = ("sum", "avg", "max", "min")

Box = tuple[tuple[int, int], ...]


@attrs.frozen(repr=False, cache_hash=True)
class Layout(metaclass=ValueMeta):
    """Canonical sharding of an ``ndim``-dim value: mesh axes per tensor dim (major
    first) and the pending reductions, as ``(axis, op)`` pairs in mesh order."""

    mesh: Mesh
    dims: tuple[tuple[str, ...], ...]
    partial: tuple[tuple[str, str], ...] = ()

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @functools.cached_property
    def axis_dim(self) -> dict[str, int]:
        """Mesh axis -> the tensor dim it shards (axes that shard nothing are absent)."""
        return {a: d for d, axes in enumerate(self.dims) for a in axes}

    @functools.cached_property
    def partial_ops(self) -> dict[str, str]:
        return dict(self.partial)

    @functools.cached_property
    def varying(self) -> tuple[bool, ...]:
        """Per mesh axis: whether shards differ along it (it shards a dim or is pending);
        computed once per layout (read on every simulated op's output: no hash each time)."""
        pending = self.partial_ops
        return tuple(a in self.axis_dim or a in pending for a in self.mesh.axis_names)

    @functools.cached_property
    def varying_sizes(self) -> tuple[int, ...]:
        """Per mesh axis: its size where shards differ along it, else 1 (the mesh-dim sizes of
        the local backend's stacked value: one copy of what is the same on every device)."""
        return tuple(g if v else 1 for g, v in zip(self.mesh.shape, self.varying))

    def is_replicated(self) -> bool:
        return not self.partial and not any(self.dims)

    def spec_str(self) -> str:
        entries = []
        for axes in self.dims:
            if not axes:
                entries.append("None")
            elif len(axes) == 1:
                entries.append(repr(axes[0]))
            else:
                entries.append("(" + ", ".join(map(repr, axes)) + ")")
        if self.partial:
            ops = {op for _, op in self.partial}
            names = tuple(a for a, _ in self.partial)
            if ops == {"sum"}:
                entries.append("partial=" + repr(names[0] if len(names) == 1 else names))
            else:
                entries.append("partial=" + repr(dict(self.partial)))
        return "P(" + ", ".join(entries) + ")"

    def placements_str(self) -> str:
        out = []
        for a in self.mesh.axis_names:
            if a in self.partial_ops:
                out.append(f"P({self.partial_ops[a]})")
            elif a in self.axis_dim:
                out.append(f"S({self.axis_dim[a]})")
            else:
                out.append("R")
        return "(" + ", ".join(out) + ")"

    def __repr__(self) -> str:
        return self.spec_str()

    def __deepcopy__(self, memo: dict) -> Layout:
        """Itself (immutable; see ``Mesh.__deepcopy__``): a compiled function's guard then
        compares an array's layout with the traced one by identity first."""
        return self

    # -- transitions used by the planner -------------------------------------------
    def with_dims(self, d: int, axes: tuple[str, ...]) -> Layout:
        dims = list(self.dims)
        dims[d] = axes
        return Layout(self.mesh, tuple(dims), self.partial)

    def with_partial(self, partial: dict[str, str]) -> Layout:
        order = self.mesh.axis_names
        return Layout(self.mesh, self.dims, tuple(sorted(partial.items(), key=lambda p: order.index(p[0]))))

    def without_partial(self) -> Layout:
        return Layout(self.mesh, self.dims, ()) if self.partial else self


_DTYPE_SHORT = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
}


def _layout_eq(self: Layout, other: object) -> bool:
    """attrs' field-by-field ``__eq__``, with identity shortcuts: the very same layout, and the very
    same mesh (compared without a call of ``Mesh.__eq__``: layouts compared by dispatch, plans and
    dict lookups are nearly always of one mesh object)."""
    if self is other:
        return True
    if other.__class__ is not self.__class__:
        return NotImplemented
    return ((self.mesh is other.mesh or self.mesh == other.mesh)  # type: ignore[attr-defined]
            and self.dims == other.dims and self.partial == other.partial)  # type: ignore[attr-defined]


Layout.__eq__ = _layout_eq  # type: ignore[method-assign, assignment]


def describe(shape: tuple[int, ...], dtype: torch.dtype, layout: Layout) -> str:
    """Compact text for error messages, e.g. ``f32[7,5] P('dp', None)``."""
    short = _DTYPE_SHORT.get(dtype, str(dtype).replace("torch.", ""))
    return f"{short}[{','.join(map(str, shape))}] {layout.spec_str()}"


def split_range(start: int, stop: int, k: int, i: int) -> tuple[int, int]:
    """Piece ``i`` of ``k`` of the range [start, stop) (ceil-sized, trailing pieces short)."""
    n = stop - start
    c = -(-n // k) if n else 0
    lo = min(i * c, n)
    hi = min(lo + c, n)
    return start + lo, start + hi


@functools.lru_cache(maxsize=65536)
def device_box(layout: Layout, shape: tuple[int, ...], device: int) -> Box:
    """The global index range, per dim, that ``device`` holds."""
    mesh = layout.mesh
    coords = mesh.coords(device)
    box = []
    for n, axes in zip(shape, layout.dims):
        lo, hi = 0, n
        for a in axes:
            i = mesh.axis_index(a)
            lo, hi = split_range(lo, hi, mesh.shape[i], coords[i])
        box.append((lo, hi))
    return tuple(box)


@functools.lru_cache(maxsize=16384)
def all_boxes(layout: Layout, shape: tuple[int, ...]) -> tuple[Box, ...]:
    return tuple(device_box(layout, shape, d) for d in range(layout.mesh.size))


@functools.lru_cache(maxsize=16384)
def local_shapes(layout: Layout, shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Local shard shape of every device, row-major."""
    return tuple(tuple(hi - lo for lo, hi in box) for box in all_boxes(layout, shape))


@functools.lru_cache(maxsize=16384)
def is_even(layout: Layout, shape: tuple[int, ...]) -> bool:
    """Whether every device's shard has the same shape (the local backend stacks them)."""
    shapes = local_shapes(layout, shape)
    return all(s == shapes[0] for s in shapes)


@functools.lru_cache(maxsize=16384)
def max_local_numel(layout: Layout, shape: tuple[int, ...]) -> int:
    """Elements in the largest shard: the padded buffer a collective moves per device."""
    return max(math.prod(s) for s in local_shapes(layout, shape))


def box_intersection(a: Box, b: Box) -> Box | None:
    out = []
    for (alo, ahi), (blo, bhi) in zip(a, b):
        lo, hi = max(alo, blo), min(ahi, bhi)
        if hi <= lo:
            return None
        out.append((lo, hi))
    return tuple(out)


def box_numel(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)
