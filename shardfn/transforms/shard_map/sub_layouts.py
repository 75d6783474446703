"""Layouts of a partial-manual shard_map (``axis_names=``), shared by its simulated
(``sub_sim``) and dist (``sub_dist``) runners: a whole-mesh layout said on the sub-mesh of
the automatic axes and back, a block's shape over the manual axes, the checks on specs
(manual axes first in each dim; no pending reduction over an automatic axis in an
out_spec), and the whole output's shape from the blocks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...values.errors import ShardingError
from ...values.layout import Layout, device_box
from ...values.mesh import Mesh
from .io import _out_layout


def _order_check(layout: Layout, manual: frozenset, where: str) -> None:
    for d, axes in enumerate(layout.dims):
        seen_auto = False
        for a in axes:
            if a in manual and seen_auto:
                raise ShardingError(
                    f"{where} shards dim {d} over {axes!r}, an automatic axis before the manual axis {a!r}; "
                    f"with axis_names= the manual axes must come first in a dim's axes (the body sees the "
                    f"block of its manual coordinates, split over the automatic axes)"
                )
            seen_auto |= a not in manual


def _varying_manual(layout: Layout, manual: frozenset) -> frozenset:
    """The manual axes an input laid out as ``layout`` varies over in the body (its split axes,
    and its pending sums' axes: each part is its own value)."""
    return frozenset(a for a in (*layout.axis_dim, *layout.partial_ops) if a in manual)

def _sub_layout(layout: Layout, sub: Mesh) -> Layout:
    """``layout`` over the sub-mesh's axes only."""
    names = sub.axis_names
    return Layout(sub, tuple(tuple(a for a in d if a in names) for d in layout.dims),
                  tuple(p for p in layout.partial if p[0] in names))


def _block_shape(layout: Layout, shape: tuple[int, ...], manual: frozenset, rank: int) -> tuple[int, ...]:
    """The shape of this rank's block over the manual axes of ``layout``."""
    mesh = layout.mesh
    only = Layout(mesh, tuple(tuple(a for a in d if a in manual) for d in layout.dims), ())
    return tuple(hi - lo for lo, hi in device_box(only, shape, rank))


def _full_layout(sub_layout: Layout, outer: Layout, manual: frozenset, summed: bool) -> Layout:
    """A sub-mesh layout said on the whole mesh: ``outer``'s manual axes first in each dim;
    with ``summed``, Partial(sum) over the manual axes ``outer`` does not use."""
    mesh = outer.mesh
    dims = tuple(
        tuple(a for a in od if a in manual) + sd for od, sd in zip(outer.dims, sub_layout.dims)
    )
    partial = dict(sub_layout.partial)
    for a, op in outer.partial:
        if a in manual:
            partial[a] = op
    if summed:
        used = set(outer.axis_dim) | set(outer.partial_ops)
        for a in manual:
            if a not in used and mesh.axis_size(a) > 1:
                partial[a] = "sum"
    return Layout(mesh, dims, ()).with_partial(partial)


def _manual_out_layout(path: str, spec: Any, ndim: int, mesh: Mesh, manual: frozenset) -> Layout:
    """Out_spec ``spec``'s layout on the whole mesh, checked for a body manual over ``manual``:
    the manual axes first in each dim, and no pending reduction over an automatic axis (the
    body's results are whole values over those)."""
    layout = _out_layout(path, spec, ndim, mesh)
    _order_check(layout, manual, f"shard_map out_specs for {path}")
    bad = [a for a, _ in layout.partial if a not in manual]
    if bad:
        raise ShardingError(
            f"shard_map out_spec {spec!r} for {path} has partial over {bad[0]!r}, which is not a manual axis: the "
            f"body's results are whole values over it; drop {bad[0]!r} from partial="
        )
    return layout


def _whole_shape(layout: Layout, block: Sequence[int], blocks: Sequence[Sequence[int]], over: Mesh,
                 manual: frozenset) -> tuple[int, ...]:
    """The whole output's shape from the bodies' blocks: ``blocks[i]`` is the block of
    device (or run) ``i`` of ``over``. A dim split over manual axes is the sum of the
    distinct blocks along it; any other dim is ``block``'s."""
    shape = []
    for d, axes in enumerate(layout.dims):
        ax = [a for a in axes if a in manual]
        if not ax:
            shape.append(block[d])
            continue
        seen: dict[tuple, int] = {}
        for i in range(over.size):
            c = over.coords(i)
            seen.setdefault(tuple(c[over.axis_index(a)] for a in ax), blocks[i][d])
        shape.append(sum(seen.values()))
    return tuple(shape)
